# Stop 37's GPU calls, from the repo root: the FP8 loss's gradient cast checked (q^T equal to q's transpose)
# and its transposed copy's tiles, SDPA's fused backends side by side (layouts too), and the reference step
# profiled (70 kernels) in the modes of $MODES.
source benchmarks/gpu_setup.sh
cd benchmarks
D=$(date +%F)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 tune_fp8_quantize.py --parts grad_cast > $OUT/grad_cast.log 2>&1; echo "tune rc=$?"
BENCH_NAME=$D-h100-sdpa-backends.json timeout 150 python3 bench_sdpa_backends.py > $OUT/sdpa.log 2>&1; echo "sdpa rc=$?"
MODES=${MODES:-inductor_cg fusion_fp8_tensorwise_drop_cg fusion_fp8_tensorwise_cg}
BENCH_NAME=$D-h100-llama-step-profile.json timeout 300 python3 bench_llama_step.py --steps 20 --profile --top 70 --modes $MODES > $OUT/step.log 2>&1; echo "step rc=$?"
tail -22 $OUT/grad_cast.log; grep -v "^{" $OUT/sdpa.log | tail -40; tail -6 $OUT/step.log
