from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.proxy.servers import EngineProcess, ProxyThread, engine_processes, external_config


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    """Two real engine workers on the bundled model, shared by the whole proxy suite."""
    with engine_processes(tmp_path_factory.mktemp("engines")) as procs:
        yield procs


@pytest.fixture
def proxy(engines: list[EngineProcess], tmp_path) -> Iterator[ProxyThread]:  # type: ignore[no-untyped-def]
    with ProxyThread(external_config(engines, tmp_path,
                                     auth={"admin_key": "admin-test"})) as p:
        yield p
