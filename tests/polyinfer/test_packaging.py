"""An installed wheel finds the bundled tiny models (not the checkout's models/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("polyinfer", "proxy", "router", "specdec", "engine", "optimizer", "loadgen")


def test_wheel_ships_the_tiny_models_and_defaults_to_them(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in (*PACKAGES, "models"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("polyinfer-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    for model in ("tiny-target", "tiny-draft"):
        for file in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"polyinfer/models/{model}/{file}" in names
    code = ("from polyinfer.config import CompiledConfig; from engine.draft_runner import "
            "resolve_model_dir; print(CompiledConfig().model); "
            "print(resolve_model_dir('models/tiny-draft'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120,
                         capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    target, draft = out.stdout.split()
    site = (tmp_path / "site" / "polyinfer" / "models").resolve()
    assert Path(target) == site / "tiny-target" and (Path(target) / "model.safetensors").is_file()
    assert Path(draft) == site / "tiny-draft" and (Path(draft) / "config.json").is_file()
