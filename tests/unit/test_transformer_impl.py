"""model.transformer_impl chooses the layer spec (issue 39, item 3): before, the actor used
`te_available()`, which only asked whether the package could be found, so a node whose TE torch
extension fails to import built the TE spec and crashed. These tests fake what a GPU node shows."""

from __future__ import annotations

import builtins
import logging
import sys
import types

import pytest
import torch

from megatron_dapo.errors import UserError
from megatron_dapo.models import transformer_impl


@pytest.fixture
def gpu_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    transformer_impl.te_status.cache_clear()
    yield
    transformer_impl.te_status.cache_clear()


def _te_installed_but_broken(monkeypatch):
    """transformer_engine is found, but its torch extension raises at import (an ABI mismatch)."""
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(transformer_impl.importlib.util, "find_spec",
                        lambda name: object() if name == "transformer_engine" else None)
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "transformer_engine.pytorch":
            raise OSError("libtransformer_engine.so: undefined symbol: _ZN3c10...")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_auto_takes_local_where_te_is_installed_but_does_not_import(gpu_node, monkeypatch, caplog):
    _te_installed_but_broken(monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert transformer_impl.choose_transformer_impl("auto") is False
    assert "megatron's local layer spec, since transformer_engine is installed but transformer_engine.pytorch " \
           "failed to import (OSError: libtransformer_engine.so: undefined symbol" in caplog.text
    assert transformer_impl.te_available() is False  # what the actor and build_model ask by default


def test_transformer_engine_where_it_cannot_run_is_one_line(gpu_node, monkeypatch):
    _te_installed_but_broken(monkeypatch)
    with pytest.raises(UserError, match=r"model.transformer_impl=transformer_engine: transformer_engine is installed "
                                        r"but transformer_engine.pytorch failed to import \(OSError"):
        transformer_impl.choose_transformer_impl("transformer_engine")


def test_local_is_local_everywhere(gpu_node, monkeypatch):
    _te_installed_but_broken(monkeypatch)
    assert transformer_impl.choose_transformer_impl("local") is False


def test_without_a_gpu_nothing_is_logged_and_te_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    transformer_impl.te_status.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert transformer_impl.choose_transformer_impl("auto") is False
        assert caplog.text == ""
        with pytest.raises(UserError, match="no CUDA device is visible"):
            transformer_impl.choose_transformer_impl("transformer_engine")
    finally:
        transformer_impl.te_status.cache_clear()
