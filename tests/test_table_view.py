"""The narrow view of a table in a notebook: one line per row, as wide as the notebook."""

from __future__ import annotations

import pandas as pd

from lab_utils.engine import table_view
from lab_utils.engine.store import display_table


def _wide(n_cols: int) -> pd.DataFrame:
    data = {"method": ["DDP", "DDP"], "devices": [1, 2]}
    data.update({f"measured_quantity_{i}_seconds": [1.5 + i, 2.5 + i] for i in range(n_cols)})
    return pd.DataFrame(data)


def test_a_long_text_becomes_a_numbered_note_once():
    reason = "OOM: batch 512 needs more than the CPU memory cap of 160 MB (a stand-in for a GPU's memory)"
    df = pd.DataFrame({"batch": [512, 1024, 32], "reason": [reason, reason, "ok"]})
    view = display_table(df)
    cells = view.parts[0].data["reason"].tolist()
    assert cells[0] == cells[1] and cells[0].endswith("[1]") and len(cells[0]) < 45 and cells[2] == "ok"
    assert view.notes == [reason]
    assert "[1] OOM: batch 512 needs more than" in view.to_html()


def test_a_narrow_table_is_one_part_with_every_column():
    view = display_table(_wide(2))
    assert len(view.parts) == 1 and list(view.parts[0].data.columns) == list(_wide(2).columns)


def test_a_wide_table_without_a_view_is_split_into_parts_that_repeat_the_key():
    df = _wide(12)
    view = display_table(df, key=["method", "devices"])
    assert len(view.parts) >= 2
    shown = [c for p in view.parts for c in p.data.columns if c not in ("method", "devices")]
    assert sorted(shown) == sorted(c for c in df.columns if c not in ("method", "devices"))
    for p in view.parts:
        assert list(p.data.columns[:2]) == ["method", "devices"]
        width = sum(table_view._width(c, p.data[c].tolist()) for c in p.data.columns)
        assert width <= table_view.WIDTH or len(p.data.columns) == 3


def test_a_wide_table_shows_its_makers_view_and_names_the_csv_of_the_rest(tmp_path):
    df = _wide(12)
    df.attrs[table_view.VIEW] = ["method", "devices", "measured_quantity_11_seconds"]
    df.attrs[table_view.SAVED] = str(tmp_path / "scaling.csv")
    view = display_table(df)
    assert len(view.parts) == 1
    assert list(view.parts[0].data.columns) == ["method", "devices", "measured_quantity_11_seconds"]
    assert view.notes == [f"11 more column(s) in {tmp_path / 'scaling.csv'}: "
                          + ", ".join(f"measured_quantity_{i}_seconds" for i in range(11))]


def test_saving_a_table_records_where_its_csv_is(store):
    df = _wide(1)
    store.save_table(df, "wide")
    assert df.attrs[table_view.SAVED] == str(store.tables_dir / "wide.csv")
