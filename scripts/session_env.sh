# Sourced by the GPU session scripts: `. scripts/session_env.sh NAME LOCAL_DIR`.
# Logs go to /tmp/NAME, archived into $OUT by the caller (the device tool returns at most 8 files),
# or to LOCAL_DIR without $OUT. Peers and extras carried as wheels in .whl/ are installed to
# /tmp/site and put on PYTHONPATH with the checkout.
export PYTHONUNBUFFERED=1
FINAL=${OUT:-}
export OUT=/tmp/$1
[ -z "$FINAL" ] && OUT=$2
rm -rf "$OUT" && mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
