#!/usr/bin/env bash
# The wheels bench/gpu_h200.sh installs on the device machine, into .whl/ (ignored by git; name it in the
# device call's `carry`). The device image has Python 3.12 with torch, timm, torchvision, scikit-image,
# sentencepiece, tensorboard, pyyaml, safetensors, tqdm, huggingface-hub and regex; it lacks DeepSpeed,
# webdataset and OpenCLIP and their own needs, and nothing can be fetched there. Versions: the ones this
# checkout's venv runs (the tested ones). DeepSpeed ships as an sdist, built here into a pure-Python wheel
# (its C++ ops are JIT-compiled on first use, on the device too).
#
#   bash bench/gpu_wheels.sh            # then: device run with carry [".whl"] and `bash bench/gpu_h200.sh`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.whl
PYVER=${PYVER:-3.12}  # the device's python3
# the device lacks these (bench/README.md "GPU runs"): DeepSpeed and its pydantic, webdataset, OpenCLIP
PKGS=(deepspeed hjson pydantic pydantic_core annotated-types typing-inspection webdataset braceexpand
      open_clip_torch ftfy wcwidth)
rm -rf "$DEST" && mkdir -p "$DEST"
for name in "${PKGS[@]}"; do
  ver=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  if [ "$name" = deepspeed ]; then  # sdist only: a py3-none-any wheel, built without its ops
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$ver"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "$name==$ver"
  fi
done
ls -1 "$DEST"
du -sh "$DEST"
