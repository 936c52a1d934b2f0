#!/usr/bin/env bash
# Build, on this machine, what a bare GPU box needs to run bench/gpu_check.sh: a folder (default
# .dev/, git-ignored) to carry there beside the working tree.
#
#   wheels/   the serving stack's wheels for the box's Python (FastAPI, uvicorn, pydantic, redis,
#             ...), downloaded for PY_VERSION (default 3.12) on manylinux x86_64, no dependencies
#   bin/ lib/ this machine's redis-server with the shared libraries it needs beyond libc, behind a
#             wrapper that points the loader at lib/ (the KV tier tests start their own Redis)
#   setup.sh  source it there: installs the wheels whose modules are missing into /tmp/site and
#             puts /tmp/site, the repo and bin/ on PYTHONPATH and PATH
#   base/     with BASE=<commit>: that commit's tree (git archive), for the benches' interleaved
#             base modes (bench/gpu_check.sh runs them when it is there)
#
# On the box (repo root):  source .dev/setup.sh && bash bench/gpu_check.sh "$OUT"
# The image seen so far (an H200 box: Python 3.12, torch 2.11, Triton 3.6, transformers 5.17,
# pytest with xdist) lacked exactly these.
set -eu
dest=${1:-.dev}
py_version=${PY_VERSION:-3.12}
mkdir -p "$dest/wheels" "$dest/bin" "$dest/lib"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py_version" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d "$dest/wheels" \
  fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn httptools \
  redis hiredis python-multipart pytest-asyncio pytest-timeout typing_extensions xgrammar \
  apache-tvm-ffi compressed-tensors loguru opentelemetry-api httpx httpcore h11 anyio sniffio \
  prometheus-client openai jiter distro 2>&1 | grep -v "^WARNING: Location" || true

server=$(command -v redis-server)
cp "$server" "$dest/bin/redis-server.real"
ldd "$server" | awk '/=> \// {print $3}' | while read -r lib; do
  case $(basename "$lib") in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;  # the box's own
    *) cp -L "$lib" "$dest/lib/" ;;
  esac
done
cat > "$dest/bin/redis-server" <<'SH'
#!/bin/sh
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/redis-server.real" "$@"
SH
chmod +x "$dest/bin/redis-server"

if [ -n "${BASE:-}" ]; then
  rm -rf "$dest/base"
  mkdir -p "$dest/base"
  git archive "$BASE" | tar -x -C "$dest/base"
fi

cat > "$dest/setup.sh" <<'SH'
# source from the repo root on the GPU box (made by bench/gpu_carry.sh)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p /tmp/site
need=""
for w in "$here"/wheels/*.whl; do
  mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  case $mod in
    python_multipart) mod=multipart ;; apache_tvm_ffi) mod=tvm_ffi ;; opentelemetry_api) mod=opentelemetry ;;
  esac
  python3 -c "import $mod" 2>/dev/null || need="$need $w"
done
if [ -n "$need" ]; then python3 -m pip install -q --no-deps --target /tmp/site $need 2>&1 | tail -3; fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=$here/bin:$PATH
echo "installed:$(for w in $need; do basename "$w" | cut -d- -f1; done | tr '\n' ' ')"
redis-server --version
SH
echo "$dest: $(ls "$dest/wheels" | wc -l) wheels, redis-server with $(ls "$dest/lib" | wc -l) libraries${BASE:+, base $BASE}; $(du -sh "$dest" | cut -f1)"
