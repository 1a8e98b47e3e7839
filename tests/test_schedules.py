"""Schedule tables (``meshtrain.parallel.schedules``): each built-in table is valid, costs what its
schedule's formula says in lock step, holds what it says in flight, and a broken table is refused
naming the first task that cannot run."""

import dataclasses

import pytest

from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.schedules import (OpCosts, ScheduleTable, Slot, Task, Work, gpipe, interleaved_1f1b,
                                          one_f_one_b, zb_h1)

BUILDERS = {"gpipe": lambda s, m: gpipe(s, m), "1f1b": lambda s, m: one_f_one_b(s, m),
            "interleaved": lambda s, m: interleaved_1f1b(s, m, 2), "zb_h1": lambda s, m: zb_h1(s, m)}


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_built_in_tables_are_valid_and_round_trip_through_json(name, stages, micro):
    table = BUILDERS[name](stages, micro)
    assert table.problems() == []
    assert ScheduleTable.from_json(table.to_json()) == table
    assert table.forward_only().problems() == []


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (8, 32)])
def test_bubbles_are_the_schedules_formulas(stages, micro):
    S, M = stages, micro
    assert gpipe(S, M).bubble() == pytest.approx((S - 1) / (M + S - 1))
    assert one_f_one_b(S, M).bubble() == pytest.approx((S - 1) / (M + S - 1))
    assert interleaved_1f1b(S, M, 2).bubble() == pytest.approx((S - 1) / (2 * M + S - 1))
    assert interleaved_1f1b(S, M, 4).bubble() == pytest.approx((S - 1) / (4 * M + S - 1))
    # Lock-step ZB-H1: (M+S-1)(F+I) + M W of time for 3M of work.
    assert zb_h1(S, M).bubble() == pytest.approx(2 * (S - 1) / (3 * M + 2 * (S - 1)))
    # Megatron's cost of 1F1B: (S-1) F + M (F+B) + (S-1) B.
    costs = OpCosts(forward=1.0, backward=2.5)
    assert one_f_one_b(S, M).time(costs) == pytest.approx((S - 1) * 1.0 + M * 3.5 + (S - 1) * 2.5)


def test_only_m_ticks_of_zb_h1_carry_a_weight_gradient_slot():
    table = zb_h1(4, 8)
    with_w = [t for t in range(len(table.ticks)) if Work.WEIGHT_GRAD in table.signature(t)[0]]
    assert len(with_w) == 8
    assert table.splits_backward and not one_f_one_b(4, 8).splits_backward


def test_in_flight_microbatches_and_buffer_sizes():
    # 1F1B in lock step: stage s holds 2(S-1-s)+1, bounded in M; GPipe holds all M.
    assert one_f_one_b(4, 32).in_flight().tolist() == [7, 5, 3, 1]
    assert one_f_one_b(4, 4).in_flight().tolist() == [4, 4, 3, 1]
    assert gpipe(4, 16).in_flight().tolist() == [16] * 4
    assert zb_h1(4, 32).in_flight().tolist() == [7, 6, 5, 4]
    # Interleaved: chunk 0's activations live 2VS - 2 ticks, chunk 1's 2S - 2: 11 chunks (5.5
    # microbatches' worth of a stage) at S = 4, V = 2, whatever M.
    assert [interleaved_1f1b(4, m, 2).peak_in_flight for m in (8, 32)] == [11, 11]
    columns, sizes = one_f_one_b(4, 32).buffers()
    assert sizes.stash == 7 and sizes.inputs == 1 and sizes.gradients == 1
    assert columns.forward.stash.shape == (len(one_f_one_b(4, 32).ticks), 4)
    # Every forward's stash slot is later released by its own backward, in the same slot.
    table = one_f_one_b(4, 8)
    columns, _ = table.buffers()
    forward, backward = columns.forward, columns.backward
    for stage in range(4):
        forwards = {int(forward.microbatch[t, stage]): int(forward.stash[t, stage])
                    for t in range(len(table.ticks)) if forward.stash[t, stage] >= 0}
        backwards = {int(backward.microbatch[t, stage]): int(backward.stash[t, stage])
                     for t in range(len(table.ticks)) if backward.stash[t, stage] >= 0}
        assert forwards == backwards and len(forwards) == 8


def _moved(table: ScheduleTable, tick: int, slot: int, to_tick: int) -> ScheduleTable:
    """``table`` with slot ``slot`` of ``tick`` moved to ``to_tick`` (appended to its slots)."""
    ticks = [list(t) for t in table.ticks]
    moved = ticks[tick].pop(slot)
    ticks[to_tick].append(moved)
    return dataclasses.replace(table, ticks=tuple(tuple(t) for t in ticks if t))


def test_broken_tables_name_the_first_task_that_cannot_run():
    table = one_f_one_b(2, 2)  # ticks: [F], [F, B], [F, B], [B]
    early_backward = _moved(table, 3, 0, 0)
    assert any("before" in p for p in early_backward.problems())
    missing = dataclasses.replace(table, ticks=table.ticks[:-1])
    assert missing.problems() == ["microbatch 1 on logical chunk 0 needs exactly one B, or one I and one W"]
    twice = dataclasses.replace(table, ticks=table.ticks + (table.ticks[0],))
    assert any("runs twice" in p for p in twice.problems())
    wrong_width = dataclasses.replace(table, ticks=((Slot(Work.FORWARD, (Task(0),)),),) + table.ticks[1:])
    assert any("names 1 stages" in p for p in wrong_width.problems())
    # A forward on stage 1 in the same tick as stage 0's: its input has not arrived.
    same_tick = ScheduleTable(2, 1, 1, ((Slot(Work.FORWARD, (Task(0), Task(0))),),))
    assert any("previous chunk's forward has arrived" in p for p in same_tick.problems())


def test_user_table_json_errors_name_the_field():
    from meshtrain.errors import ConfigError
    with pytest.raises(ConfigError, match=r"pipeline.table"):
        ScheduleTable.from_json('{"stages": 2, "ticks": []}')
    with pytest.raises(ConfigError, match=r"pipeline.table"):
        ScheduleTable.from_json("not json")


def test_a_custom_schedule_reads_the_table_of_its_file(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(one_f_one_b(2, 4).to_json())
    assert PipelineConfig(4, Schedule.CUSTOM, table=str(table)).schedule_table(2) == one_f_one_b(2, 4)


def test_a_table_file_that_is_not_utf8_is_one_line_naming_the_field(tmp_path):
    """Issue 38 item 13: a binary file given as pipeline.table was a UnicodeDecodeError traceback."""
    from meshtrain.errors import ConfigError

    table = tmp_path / "table.json"
    table.write_bytes(b'{"stages": 2, \xff\xfe}')
    with pytest.raises(ConfigError, match="is not UTF-8 text") as error:
        PipelineConfig(2, Schedule.CUSTOM, table=str(table)).schedule_table(2)
    assert error.value.field == "pipeline.table"
