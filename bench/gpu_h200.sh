#!/usr/bin/env bash
# GPU checks and measurements on one H200 (the device machine), as one prepared script (~8 min).
#
#   1. fp16 and bf16 training through the real CLI (fp16 cannot run on CPU), one demo epoch each:
#      `deepspeed --num_gpus 1 --module dsclip train` with ZeRO-2 fp16 (NCCL, device binding by the
#      launcher), then `python -m dsclip train` with ZeRO-2 bf16 and the gradient cache (--accum-freq 2,
#      the one-rank flat flush). Each run's zero-shot line against the CPU fp32 result in README.
#   2. bench/gpu_bench.py: dsclip vs open_clip_train samples/s, peak memory and MFU (bf16, fused AdamW,
#      same synthetic batches, alternated) for ViT-B-32 and ViT-L-14; dsclip with its default engine patches
#      and with none (--engine-patches none: DeepSpeed's own paths; issue #31's goal: default >= 1.15x).
#   3. bench/gpu_bench.py --trainers dsclip_zero2_k2,dsclip_zero3_k2,dsclip_zero3_linear_on_k2,
#      dsclip_zero3_no_blocks_k2: ZeRO-3 (the shipped JSON, with torch's linear, with DeepSpeed's autograd
#      linear, its default, and with DeepSpeed's hooks on the leaf blocks instead of zero3_blocks) against ZeRO-2
#      at ViT-L-14 and ViT-H-14, bf16,
#      gradient cache K = 2 (issue #29). Stage zero3_profile (~2 min, not in the default set): the ZeRO-3
#      step's kernel time against its wall time, and its host cProfile (bench/gpu_profile.py).
#      The next lease for issue #29, as two calls (one call may run 10 min): STAGES="zero3 zero3_profile"
#      (~5 min), then at once STAGES="bigg" (~6 min).
#   4. input (~2 min, not in the default set: the four above already fill ~10 min): bench/gpu_input.py, the GPU
#      input path (issue #28): nvJPEG images/s alone, and `dsclip train --model ViT-B-32` from real-photo shards
#      with --data-decode gpu and 8 workers against synthetic in-memory batches. Needs scikit-image's photos
#      (in the device image). Run it alone or in place of a stage: STAGES="input" bash bench/gpu_h200.sh
#   6. world (~8 min, not in the default set): bench/gpu_world.py, rank 0 of a world-8 / world-64 job under torch's
#      fake process group (issue #49): ViT-B-32 (512), ViT-L-14 (128), ViT-H-14 (64, checkpointing), bf16, ZeRO-2
#      with the default patches and with none, ZeRO-1, ZeRO-3; measured memory and step time beside dsclip plan's;
#      first ViT-bigG-14 ZeRO-2 at world 32 with checkpointing, its peak memory against the plan's.
#   7. world_reductions (~7 min, not in the default set; issue 57, pending: no device lent to that task): the two
#      gradient reductions (--grad-reduction sharded / coalesced) at world 8 and 64, ZeRO-2 and ZeRO-3.
#   5. bigg (~6 min, not in the default set either): bench/gpu_plan_check.py, ViT-bigG-14 under ZeRO-3 with
#      --grad-checkpointing (issue #29): the largest micro-batch that fits (probes at dsclip plan's answer and
#      one 15 % step from it), its peak memory, step time and MFU against the plan's. Measured 2026-12-04
#      (results/gpu-h200_h200_2026-12-04.md): zero3 150 s, input 95 s, bigg's OOM probes 70 s.

# (Measured once and not repeated each lease: bench/utilisation.py --device cuda, the GEMM rate at the ViT
# block shapes; bench/gpu_bench.py's loss-memory rows, --loss-sizes 32768,65536,131072.)
# Results land in $OUT (or ./gpu_results): logs and JSON.
#
# The device machine has its own python3 with torch and timm; what dsclip needs beyond that travels as
# wheels in .whl/ (bash bench/gpu_wheels.sh; bench/README.md, "GPU runs"). Usage (repo root):  bash bench/gpu_h200.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_results}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
  "$PY" -c "import torch, deepspeed, open_clip, timm; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'open_clip', open_clip.__version__, 'timm', timm.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/env.txt"

# the stages to run (names below); the default set stays under ~10 min
STAGES=${STAGES:-"fp16_zero2_launcher bf16_zero2_gradcache gpu_bench zero3"}
stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, keep going on failure
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  grep -E "^dsclip:|^step |zeroshot|^final|Error|error:|^\| |TFLOP|OOM|samples/s, |^== |^nvJPEG|^real / |^probe " "$OUT/$name.log" \
    | grep -v "^\[" | tail -n 30 | tee -a "$OUT/summary.txt"
}

DEMO=(--config demo --logs "$OUT/runs" --demo-num-samples 16384 --epochs 1 --batch-size 128 --workers 6
      --log-every-n-steps 32 --save-frequency 0)
stage fp16_zero2_launcher 50 deepspeed --num_gpus 1 --master_port 29611 --module dsclip train "${DEMO[@]}" \
  --name fp16_zero2 --deepspeed-config zero2_fp16 --precision fp16
stage bf16_zero2_gradcache 50 "$PY" -m dsclip train "${DEMO[@]}" --name bf16_zero2_accum2 \
  --deepspeed-config zero2_bf16 --precision bf16 --accum-freq 2 --batch-size 64
# also the seam (issue #31): dsclip with its default patch set and with none (DeepSpeed's own paths)
stage gpu_bench 290 "$PY" bench/gpu_bench.py --models ViT-B-32=512,ViT-L-14=128 --rounds 2 --steps 8 \
  --trainers openclip,dsclip,dsclip_patches_none --assume-fits --loss-sizes ""
# ZeRO-3 against ZeRO-2 with the gradient cache (issue #29; target >= 0.9x): the shipped JSON (each Block a
# leaf) and stock ZeRO-3; MFU per row. (flush_check, gpu_profile and torchcompile were measured in the
# 2026-11-30 / 12-01 leases, results/gpu-h200_h200_*.md, and are left out to keep this script under 10 min.)
# (2026-12-04: 0.30x at ViT-L-14, 0.39x at ViT-H-14; stock ZeRO-3 without leaf blocks 0.17x, not repeated.)
stage zero3 240 "$PY" bench/gpu_bench.py --models ViT-L-14=128,ViT-H-14=64 --rounds 1 --steps 6 \
  --trainers dsclip_zero2_k2,dsclip_zero3_k2,dsclip_zero3_linear_on_k2,dsclip_zero3_no_blocks_k2 --assume-fits --loss-sizes ""
# where ZeRO-3's step goes on the GPU: kernel time against wall time, the top kernels, a cProfile of the host
stage zero3_profile 150 "$PY" bench/gpu_profile.py --model ViT-L-14 --batch 128 --accum-freq 2 --steps 4 \
  --variants dsclip-engine --ds-json "zero3_{p}" --top 25 --cprofile 35
# the GPU input path (issue #28): nvJPEG alone; real-photo shards with --data-decode gpu vs synthetic batches
stage input 170 "$PY" bench/gpu_input.py --workers 8 --steps 96 --out "$OUT/input.json"
# dsclip plan against a measured bigG run (issue #29; targets: memory within 15 %, step time within 25 %)
# (2026-12-04 its probes ran without checkpointing, a bench bug since fixed; with it the plan's micro-batch
# 1,297 takes ~12-25 s a step, so each probe is two warm-up steps and one timed step)
stage bigg 360 "$PY" bench/gpu_plan_check.py --model ViT-bigG-14 --zero 3 --grad-checkpointing --steps 1 \
  --max-probes 2 --probe-timeout 170 --json-out "$OUT/bigg.json"
# one rank of a world-8 and a world-64 job on this GPU (issue #49): torch's fake process group answers the
# collectives, so each row is rank 0's GPU time at that world size, with the communication model's time apart
# (bench/gpu_world.py). Not in the default set; run alone, one call (<= 8 min): STAGES="world" bash bench/gpu_h200.sh
# First ViT-bigG-14 ZeRO-2 at world 32 with checkpointing: measured peak memory beside the plan's (goal: within
# 10 %), one child of at most 100 s (a 2.5 B model built, 1 warm-up + 2 steps of 64 rows at ~1 s each). Then six
# children (2 worlds x 3 models), each ZeRO-2 with dsclip's default patches and with none, ZeRO-1, ZeRO-3, at most
# 60 s each: 100 + 6 x 60 = 460 s under the stage's 470 (a child past its cap prints "failed" and the rest go on).
stage world 470 "$PY" bench/gpu_world.py --memory-check 32:ViT-bigG-14=64:ckpt:zero2 --memory-timeout 100 \
  --worlds 8 64 --models ViT-B-32=512,ViT-L-14=128,ViT-H-14=64:ckpt \
  --configs zero2,zero2_none,zero1,zero3 --steps 3 --timeout 60 --json-out "$OUT/world.json"
# both gradient reductions at world 8 and 64 (issue 57): first ZeRO-2/3 sharded at K = 4 (four reductions a step,
# each inside its chunk's backward), then sharded against coalesced (the whole .grad, one reduction at the
# boundary) side by side at K = 1 (dsclip train refuses bf16 coalesced with K > 1); step time, exposed
# communication, peak memory and the gradient bytes beside the plan's. Not in the default set; one call:
# STAGES="world_reductions" bash bench/gpu_h200.sh (4 children x <= 100 s).
stage world_reductions 430 bash -c '"$0" bench/gpu_world.py --worlds 8 64 --models ViT-B-32=128,ViT-L-14=32 \
  --configs zero2,zero3 --accum-freq 4 --steps 3 --timeout 100 --json-out "$1/world_sharded.json" && \
  "$0" bench/gpu_world.py --worlds 8 64 --models ViT-B-32=512,ViT-L-14=128 --configs zero2,zero2_coalesced,zero3,zero3_coalesced \
  --accum-freq 1 --steps 3 --timeout 100 --json-out "$1/world_reductions.json"' "$PY" "$OUT"
rm -rf "$OUT/runs"  # checkpoints stay on the machine; the logs above hold the numbers
echo "results: $OUT/summary.txt"
