"""The `fusion` torch.compile backend: canonicalize, match, decide, rewrite, hand the rest off.

    torch.compile(model, backend="fusion")                          # entry point, default config
    torch.compile(model, backend=fusion_compiler.backend(config))   # explicit config
    fusion_compiler.compile(model, fusion_compiler.backend(config)) # the same, with the backend's
                                                                    # Dynamo settings (see compile)
"""
import contextlib
import dataclasses
import traceback

import torch
import torch.fx as fx

from . import _compat, cache_key, engine, overlap, recompute, state_update
from . import ops  # noqa: F401  (registers the project's custom ops)
from .canonical import Unsupported, to_aten
from .config import ConfigError, FusionConfig
from .constants import EXAMPLE
from .decisions import Decision, DecisionLog


class FusionBackend:
    """A Dynamo backend with its own config and decision log (one per torch.compile call is usual)."""

    def __init__(self, config: FusionConfig | None = None):
        self.config = config if config is not None else FusionConfig()
        self.log = DecisionLog()
        self.graphs = 0
        self.rewritten: list[fx.GraphModule] = []  # the canonical ATen graphs handed off, after rewriting
        self.overlap: overlap.OverlapPass | None = None  # the last collective scheduling pass (its .graphs)
        # Dynamo's optimize() reads this attribute of a backend and enters it around each call of the
        # compiled function (torch.compile wraps the backend first and drops it: see compile below)
        self.backend_ctx_ctor = _compat.capture_dynamic_output_shapes \
            if self.config.capture_dynamic_output_shapes else contextlib.nullcontext

    def __call__(self, gm: fx.GraphModule, example_inputs):
        gid = self.graphs
        self.graphs += 1
        if state_update.is_update(gm):
            compiled = self._state_update(gm, example_inputs, gid)
            if compiled is not None:
                return compiled
            if state_update.has_tensor_attributes(gm):  # an optimizer step left as it is (rows say why)
                return self._handoff(gm, example_inputs)
        try:
            aten_gm, _ = to_aten(gm, example_inputs)
            training = torch.is_grad_enabled()
            grad_inputs = [training and isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs]
            placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
            for ph, t in zip(placeholders, example_inputs):  # cost hints (constants.example_value)
                if isinstance(t, torch.Tensor) and not isinstance(t, _compat.FakeTensor):
                    ph.meta[EXAMPLE] = t
            try:
                engine.run(aten_gm, self.config, self.log, gid, grad_inputs)
                # the marks steer Inductor's partitioner: with another hand-off they would change nothing
                marked = recompute.mark(aten_gm, self.log, gid) if self.config.prefer_memory and any(grad_inputs) \
                    and self.config.handoff == "inductor" else []
            finally:  # the graph must not keep the first call's tensors alive
                for ph in placeholders:
                    ph.meta.pop(EXAMPLE, None)
            self.rewritten.append(aten_gm)
        except Unsupported as e:
            self._fallback(gid, str(e))
            return self._handoff(gm, example_inputs, gid)
        except ConfigError:
            raise  # unknown pattern or family names: the user's to fix
        except Exception as e:  # noqa: BLE001  (a bug of ours must not stop training)
            self._internal_error(gid, "graph", e)
            return self._handoff(gm, example_inputs)
        try:
            patches = {"joint_custom_pre_pass": recompute.JointCheck(marked, self.log, gid)} if marked else {}
            _compat.carry_dynamo_input_marks(gm, aten_gm)  # CUDA graphs: parameters keep their address
            return self._handoff(aten_gm, example_inputs, gid, patches)
        except Exception as e:  # noqa: BLE001  (the rewritten graph failed to compile: undo, say why)
            self._handoff_failed(gid, "graph", e)
            return self._handoff(gm, example_inputs)

    def _state_update(self, gm: fx.GraphModule, example_inputs, gid: int):
        """An in-place update outside autograd (an optimizer step): its lanes become multi-tensor
        launches (patterns/optimizer.py); tensors Dynamo holds as attributes are passed as trailing
        inputs. None when no lane was fused (the graph then takes the usual path)."""
        from fusion_compiler.patterns import optimizer
        self.config.check_names(engine.known_names())
        try:
            lifted, values, attributes = state_update.lift(gm)
            inputs = [*example_inputs, *values]
            grads = state_update.gradient_inputs([*example_inputs, *attributes])
            aten_gm = state_update.trace(lifted, inputs)
            foreach = state_update.uses_foreach(gm)
            applied = optimizer.rewrite(aten_gm, inputs, grads, foreach, self.config, self.log, gid,
                                        report_unfused=bool(grads) or state_update.has_tensor_attributes(gm))
        except Unsupported as e:
            self._fallback(gid, str(e))
            return None
        except Exception as e:  # noqa: BLE001  (a bug of ours must not stop training)
            self._internal_error(gid, "update", e)
            return None
        if not applied:
            return None
        self.rewritten.append(aten_gm)
        try:
            # outside Dynamo's tracing context: its shape environment holds the symbol of a float
            # hyper-parameter read with .item(), which this graph reads as a tensor instead (AOT would
            # take the missing symbol for a specialization and restart Dynamo with the float baked in)
            with _compat.tracing(None), torch.no_grad():
                compiled = self._handoff(aten_gm, inputs, gid)
        except Exception as e:  # noqa: BLE001
            self._handoff_failed(gid, "update", e)
            return self._handoff(gm, example_inputs)

        def step(*args):
            with torch.no_grad():
                return compiled(*args, *values)
        return step

    def _fallback(self, gid: int, reason: str) -> None:
        self.log.add(Decision(gid, "-", "-", "fallback", reason, "", ()))

    def _internal_error(self, gid: int, what: str, e: Exception) -> None:
        self._fallback(gid, f"internal error, {what} left to {self.config.handoff}: {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc(limit=4)}")

    def _handoff_failed(self, gid: int, what: str, e: Exception) -> None:
        self._fallback(gid, f"{self.config.handoff} failed on the rewritten {what}, compiled the original "
                            f"instead: {type(e).__name__}: {str(e)[:300]}")

    def _handoff(self, gm: fx.GraphModule, example_inputs, gid: int = -1, patches: dict | None = None):
        """patches: Inductor config patches of the rewritten graph (the recompute marks' joint pass)."""
        patches = dict(patches or {})
        if self.config.cudagraphs:
            patches["triton.cudagraphs"] = True
        if self.config.handoff == "inductor":
            dist = torch.distributed
            if self.config.overlap_collectives and dist.is_available() and dist.is_initialized():
                # post-grad pass, forward and backward (config_patches reach the lazily compiled backward)
                self.overlap = overlap.OverlapPass(self.log, gid, self.config.overlap_memory_budget,
                                                   chunks=self.config.overlap_chunks)
                patches["post_grad_custom_post_pass"] = self.overlap
            # our ops' code in the cache keys (a configured pre-pass still runs, chained)
            ops_key = cache_key.pre_pass(_compat.inductor_config.post_grad_custom_pre_pass)
            if ops_key is not None:
                patches["post_grad_custom_pre_pass"] = ops_key
            return _compat.compile_fx(gm, example_inputs, config_patches=patches)
        if self.config.handoff == "aot_eager":
            return _compat.aot_eager(gm, example_inputs)
        return gm


def backend(config: FusionConfig | None = None, **overrides) -> FusionBackend:
    """A backend for torch.compile: backend(FusionConfig(...)) or backend(handoff="aot_eager", ...)."""
    if overrides:
        config = FusionConfig(**overrides) if config is None else dataclasses.replace(config, **overrides)
    return FusionBackend(config)


DEFAULT = FusionBackend()


def fusion_backend(gm: fx.GraphModule, example_inputs):
    """The entry point behind backend="fusion" (default config; decisions in fusion_compiler.last_report())."""
    return DEFAULT(gm, example_inputs)


def compile(model, backend: FusionBackend | None = None, *, fullgraph: bool = False, dynamic: bool | None = None):
    """torch.compile(model, backend=backend) with the backend's Dynamo settings in force whenever the
    compiled model runs: with FusionConfig.capture_dynamic_output_shapes (the default) a per-expert
    MoE loop over range(num_experts) (transformers 4.x) is one graph, which the MoE family fuses.
    torch.compile wraps any backend in its own object and drops those settings; with it, set
    torch._dynamo.config.capture_dynamic_output_shape_ops = True yourself for the same effect. Code that
    Dynamo already compiled in this process without the setting keeps its graph breaks until
    torch.compiler.reset().
    backend: a FusionBackend (its .log holds the decisions); None: a new one, default config."""
    backend = backend if backend is not None else FusionBackend()
    return _compat.dynamo_optimize(backend, nopython=fullgraph, dynamic=dynamic)(model)
