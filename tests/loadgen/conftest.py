"""Fixtures for loadgen tests: the scripted loopback upstream and the bundled tokenizer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polyinfer.config import TINY_TARGET
from tests.loadgen.upstream import ScriptedUpstream

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    await server.start()
    yield server
    await server.close()


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return TINY_TARGET


@pytest.fixture(scope="session")
def synth():  # type: ignore[no-untyped-def]
    """One synthesizer for the session: building it tokenizes the whole corpus (~1 s)."""
    from loadgen.synth import PromptSynthesizer
    from loadgen.tokenizer import load_token_counter

    return PromptSynthesizer(load_token_counter(TINY_TARGET), block_tokens=64, seed=0)
