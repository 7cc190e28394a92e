"""The preprocess stage on a real two-node Ray cluster (head + one more node, both on this machine).

Slow (a cluster takes ~5 s to start and ~0.7 GB while up) and skipped when ray is not installed
(`pip install astrai[ray]`; CI installs it through the `test` extra).
"""

import os

import pytest

pytestmark = pytest.mark.slow


def test_the_cluster_runs_tasks_on_both_nodes(ray_cluster):
    import ray

    @ray.remote(num_cpus=1)  # each node of the fixture's cluster has one CPU
    def where(_):
        import time

        time.sleep(0.3)  # both tasks are running at once, so they cannot share a one-CPU node
        return ray.get_runtime_context().get_node_id(), os.environ.get("ASTRAI_FAULT_DIR")

    ray.init(address=ray_cluster, logging_level="ERROR", log_to_driver=False)
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        got = ray.get([where.remote(i) for i in range(2)])
    finally:
        ray.shutdown()
    assert len({node for node, _ in got}) == 2
    assert {fault_dir for _, fault_dir in got} == {os.environ["ASTRAI_FAULT_DIR"]}
