# From the repo root with the torchao wheel carried in .whl/ (stop 37's third call; the next session's first):
# the causal-mask rewrite (patterns/sdpa_causal.py) checked against eager on a 1-layer reference Llama, then
# the reference step profiled: Inductor, our FP8 with and without drop_logits, torchao float8, fusion bf16,
# our FP8 with prefer_memory (all with CUDA graphs). MODES overrides the list.
source benchmarks/gpu_setup.sh
cd benchmarks
D=$(date +%F)
nvidia-smi --query-gpu=name --format=csv,noheader
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
timeout 100 python3 check_attention_gpu.py > $OUT/check.log 2>&1; rc=$?; echo "check rc=$rc"
if [ $rc -ne 0 ]; then grep -v "^  " $OUT/check.log | tail -25 | cut -c1-400; exit 1; fi  # save the device time for a fix
MODES=${MODES:-inductor_cg fusion_fp8_tensorwise_drop_cg torchao_fp8_cg fusion_fp8_tensorwise_cg fusion_cg fusion_fp8_tensorwise_mem_drop_cg}
BENCH_NAME=$D-$G-llama-step-attention.json timeout 460 python3 bench_llama_step.py --steps 20 --profile --top 40 --modes $MODES > $OUT/step.log 2>&1; echo "step rc=$?"
grep -v "^{" $OUT/check.log | tail -16; grep -c "sdpa_causal_mask.*applied" $OUT/step.log; grep -m2 "sdpa_causal_mask" $OUT/step.log | cut -c1-300; tail -8 $OUT/step.log
