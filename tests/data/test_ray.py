"""The preprocess stage on a real two-node Ray cluster (head + one more node, both on this machine).

Slow (a cluster takes ~5 s to start and ~0.7 GB while up) and skipped when ray is not installed
(`pip install astrai[ray]`; CI installs it through the `test` extra).
"""

import os
import shutil
import tempfile

import pytest

pytestmark = pytest.mark.slow

NODE_CPUS = 1  # two nodes x one CPU: two tasks at a time, one per node, on the 2-core machine
OBJECT_STORE = 100 * 2 ** 20  # Ray would take 30% of RAM per node; tasks here pass only small plans


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of a running two-node local cluster; the test session's driver is not connected.

    RAY_TMPDIR keeps the sessions' sockets and logs in a private, short directory (unix socket
    paths are limited to ~107 bytes) and is inherited, like the rest of this environment, by every
    node's workers, so variables set here before the start reach the tasks."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="astrai-ray-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "ASTRAI_FAULT_DIR")}
    os.environ["RAY_TMPDIR"] = tmp
    os.environ["ASTRAI_FAULT_DIR"] = os.path.join(tmp, "faults")
    os.makedirs(os.environ["ASTRAI_FAULT_DIR"])
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_cluster_runs_tasks_on_both_nodes(ray_cluster):
    import ray

    @ray.remote(num_cpus=NODE_CPUS)
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
