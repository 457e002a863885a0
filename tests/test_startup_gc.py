"""Start-up runs without cyclic collections, restores the collector's state after, and can freeze what it built."""
import gc

from inferno.core.startup_gc import gc_paused


def test_paused_then_restored_and_nested_pauses_do_not_resume_early():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it paused: the outer one resumes it
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a program that had it off keeps it off
    finally:
        gc.enable()


def test_freeze_leaves_what_the_block_built_out_of_later_collections():
    gc.unfreeze()
    try:
        with gc_paused(freeze=True):
            built = [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= len(built) and gc.isenabled()
        tracked = {id(o) for o in gc.get_objects()}  # the frozen generation is not scanned
        assert id(built[0]) not in tracked
    finally:
        gc.unfreeze()
