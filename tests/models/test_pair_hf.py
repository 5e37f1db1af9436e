"""The bundled pair loads and generates in Hugging Face transformers."""

from __future__ import annotations

import json

import pytest

from polyinfer.config import TINY_DRAFT, TINY_TARGET

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY_TARGET)


def test_pair_shares_tokenizer_and_fits_the_budget():
    assert (TINY_TARGET / "tokenizer.json").read_bytes() == (TINY_DRAFT / "tokenizer.json").read_bytes()
    target = json.loads((TINY_TARGET / "config.json").read_text())
    draft = json.loads((TINY_DRAFT / "config.json").read_text())
    assert target["vocab_size"] == draft["vocab_size"] <= 16384
    assert target["head_dim"] == draft["head_dim"] == 64
    weights = sum((d / "model.safetensors").stat().st_size for d in (TINY_TARGET, TINY_DRAFT))
    assert weights <= 40 * 1024 * 1024


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


@pytest.mark.parametrize("path, lo, hi", [(TINY_TARGET, 5e6, 25e6), (TINY_DRAFT, 0, 25e6 / 4)])
def test_loads_and_generates(tokenizer, path, lo, hi):
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    assert lo <= num_params <= hi
    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    new = out[0, ids.shape[1]:]
    assert new.numel() == 16
    assert tokenizer.decode(new).strip()  # real text, not only special tokens


def test_draft_is_much_smaller_and_agrees_with_target_on_code(tokenizer):
    target = transformers.LlamaForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32)
    draft = transformers.LlamaForCausalLM.from_pretrained(TINY_DRAFT, dtype=torch.float32)
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    assert n_d * 4 <= n_t
    code = (
        "import os\n\n\ndef list_python_files(root):\n"
        "    \"\"\"Return the paths of all Python files under root.\"\"\"\n"
        "    result = []\n    for dirpath, dirnames, filenames in os.walk(root):\n"
        "        for name in filenames:\n            if name.endswith('.py'):\n"
        "                result.append(os.path.join(dirpath, name))\n    return result\n"
    )
    ids = tokenizer(code, return_tensors="pt").input_ids
    with torch.no_grad():
        agree = (target(ids).logits.argmax(-1) == draft(ids).logits.argmax(-1)).float().mean()
    assert agree.item() > 0.3  # chance is ~1e-4
