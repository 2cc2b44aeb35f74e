#!/usr/bin/env bash
# The accelerator checks of sahajBERT in one call: bash bench/gpu_check.sh OUT_DIR
#
# 1. correctness on the GPU backend: the model tests (bf16 against fp32 included) and the
#    collaborative-transform tests (on a GPU the jitted step takes the portable host callback);
# 2. throughput: bench.model --gpu-only (sahajBERT, sequence 512, bf16 compute, fp32 master
#    weights, LAMB step) for several batches, both attention kernels, remat on and off;
# 3. a collaboration on the GPU: the demo with two trainer processes and --bf16 sharing the one
#    GPU (memory fractions set), peers bit-identical, per-epoch against compute-only time.
# Everything goes to OUT_DIR (logs, model.jsonl, demo/, summary.json). Without a GPU it writes
# summary.json saying so and exits 0 (a dry run on the CPU). Budget: about 8 minutes of GPU time.
# On a machine that lacks some of the project's pure-Python dependencies, wheels in .whl/ are
# installed into /tmp/site first (see README: "sahajBERT on a GPU").
set -uo pipefail
OUT=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

if [ -d .whl ] && ! $PY -c "import trio, cryptography, msgpack" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 || echo "wheel install failed" >>"$OUT/steps.txt"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

backend=$($PY -c "import jax; print(jax.default_backend())" 2>"$OUT/backend.err")
if [ "$backend" != "gpu" ]; then
  printf '{"gpu_ran": false, "skipped": "no GPU: JAX backend is %s"}\n' "${backend:-unavailable}" \
    | tee "$OUT/summary.json"
  exit 0
fi
$PY -c "import jax; print(jax.__version__, jax.devices())" >"$OUT/devices.txt" 2>&1
step() {  # step NAME SECONDS CMD...: run with a time limit, log, record the exit status
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/steps.txt"
}

# 1. correctness (JAX_PLATFORMS unset: the GPU is the default backend)
step tests 150 $PY -m pytest -q -x -p no:cacheprovider -m 'not slow' \
  tests/models/test_albert.py tests/models/test_hf.py tests/dedloc_jax/test_collaborative.py

# 2. throughput variants (each prints one JSON line last)
: >"$OUT/model.jsonl"
for variant in "--gpu-batch 32" "--gpu-batch 64" "--gpu-batch 128" \
  "--gpu-batch 64 --gpu-attention cudnn" "--gpu-batch 64 --gpu-attention xla" \
  "--gpu-batch 128 --gpu-remat"; do
  name="model_$(echo "$variant" | tr -c 'a-z0-9' '_')"
  # shellcheck disable=SC2086
  step "$name" 60 $PY -m bench.model --gpu-only $variant
  tail -n 1 "$OUT/$name.log" | grep '^{' >>"$OUT/model.jsonl"
done

# 3. two bf16 trainers and a coordinator sharing the GPU
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.25
step demo 150 $PY -m examples.sahajbert demo --bf16 --demo-trainers 2 --demo-epochs 8 \
  --out "$OUT/demo" --work-dir "$OUT/work"

$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {"gpu_ran": True, "devices": (out / "devices.txt").read_text().strip()}
summary["steps"] = (out / "steps.txt").read_text().split("\n")
summary["model"] = [json.loads(l) for l in (out / "model.jsonl").read_text().splitlines() if l]
rows = out / "demo" / "metrics.jsonl"
if rows.exists():
    epochs = [json.loads(l) for l in rows.read_text().splitlines() if l]
    # compute-only time of an epoch: its samples at the rate the peers computed
    summary["demo_epochs"] = [
        {k: e.get(k) for k in ("epoch", "samples", "peers", "seconds", "samples_per_second")}
        for e in epochs
    ]
demo_log = (out / "demo.log").read_text() if (out / "demo.log").exists() else ""
summary["demo_bit_identical"] = "bit-identical: True" in demo_log
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary)[:4000])
EOF
