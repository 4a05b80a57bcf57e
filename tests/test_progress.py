"""Progress bars: text, never a widget (a reopened notebook cannot show a widget it did not save)."""

from __future__ import annotations

import sys
import types

from lab_utils.learn import progress


def test_in_a_notebook_the_bar_is_text_not_a_widget(monkeypatch, capsys):
    monkeypatch.delenv("LAB_HEADLESS", raising=False)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))   # as in JupyterLab
    bar = progress.progress(range(3), desc="epoch")
    assert type(bar).__module__ == "tqdm.std" and not bar.disable
    assert list(bar) == [0, 1, 2]
    out = capsys.readouterr().out
    assert "epoch" in out and "widget" not in out


def test_headless_the_bar_is_off(monkeypatch, capsys):
    monkeypatch.setenv("LAB_HEADLESS", "1")
    bar = progress.progress(range(3), desc="epoch")
    assert bar.disable and list(bar) == [0, 1, 2]
    assert capsys.readouterr().out == ""
