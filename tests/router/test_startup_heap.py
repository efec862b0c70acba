"""The router's startup heap is frozen out of the garbage collector while it
serves (services/router/app.py, `startup_heap_frozen`) and given back at
shutdown, with the collector's thresholds as they were."""

import gc

from services.router.app import startup_heap_frozen


def _collector_sees(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_startup_objects_are_frozen_while_serving_and_released_after():
    before = gc.get_threshold()
    built_at_startup = [[]]  # a container: tracked by the collector
    with startup_heap_frozen():
        built_while_serving = [[]]
        assert not _collector_sees(built_at_startup)
        assert _collector_sees(built_while_serving)
        assert gc.get_threshold()[0] > before[0]  # young collections less often
    assert _collector_sees(built_at_startup)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
