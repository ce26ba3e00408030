"""The step model (``gpucomm.tuning``): the α-β fit on synthetic samples with known α and β, the
step timeline against hand-computed cases, NCCL's cost model against values derived by hand from
its constants, the dynamic program against brute force on small random instances, and the plans'
conversion into gpucomm's bucket records."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
import torch

from gpucomm.dataplane.fusion import plan_buckets
from gpucomm.tuning import (AlphaBeta, Cluster, FitError, Graph, NcclModel, Overheads, Profile, capped_buckets,
                            cycle_schedule, fit_alpha_beta, graph_for, optimal_plan, predict_step, ring_allreduce,
                            scaling_efficiency, simulate)
from gpucomm.tuning.flops import analytic_profile
from gpucomm.tuning.optimal import buckets_from_cuts
from gpucomm.tuning.plans import to_fusion_buckets, to_groups
from gpucomm.tuning.straggler import Stragglers, expected_max_normal, fit_cv
from tests.harness import PYTHON, run

# -- the α-β fit -----------------------------------------------------------------------------------


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_exact_alpha_beta(relative):
    alpha, bw = 37e-6, 2.5e9
    samples = [(b, alpha + b / bw) for b in (1024, 65536, 1 << 20, 16 << 20, 64 << 20)]
    fit = fit_alpha_beta(samples, relative=relative)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=1e-9)


def test_fit_with_noise_stays_close_and_weighs_small_sizes():
    rng = random.Random(7)
    alpha, bw = 80e-6, 1.2e9
    samples = [(b, (alpha + b / bw) * (1 + rng.uniform(-0.03, 0.03)))
               for b in (4096, 16384, 65536, 1 << 20, 8 << 20, 32 << 20) for _ in range(9)]
    fit = fit_alpha_beta(samples)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.1)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=0.05)


def test_fit_clamps_a_negative_intercept_and_refuses_bad_samples():
    fit = fit_alpha_beta([(1000, 0.5e-6), (2000, 1.5e-6)])  # the line would cross zero below 500 B
    assert fit.alpha_s == 0.0 and fit.bandwidth_Bps > 0
    with pytest.raises(FitError, match="two or more distinct sizes"):
        fit_alpha_beta([(1024, 1e-4), (1024, 2e-4)])
    with pytest.raises(FitError, match="not \\(bytes >= 0, seconds > 0\\)"):
        fit_alpha_beta([(1024, 0.0), (2048, 1e-4)])
    with pytest.raises(FitError, match="does not grow with the size"):
        fit_alpha_beta([(1024, 2e-4), (1 << 20, 1e-4)])


def test_ring_allreduce_from_link_latency_and_bandwidth():
    ab = ring_allreduce(4, 5e-6, 10e9)  # 6 steps of 1/4 of the data
    assert ab.alpha_s == pytest.approx(30e-6)
    assert ab(4_000_000) == pytest.approx(30e-6 + 6 * 1_000_000 / 10e9)
    assert ring_allreduce(1, 5e-6, 10e9)(1 << 30) == 0.0


# -- the step timeline -----------------------------------------------------------------------------


def test_step_timeline_by_hand():
    # gradients ready at 0.1, 0.2, 0.5 s; 100, 200, 300 B; a collective costs 0.01 s + bytes / 1000 B/s
    cost = AlphaBeta(0.01, 1000.0)
    pred = simulate([0.1, 0.2, 0.5], [100, 200, 300], [[0, 1], [2]], cost, forward_s=0.05, update_s=0.02)
    b0, b1 = pred.buckets
    assert (b0.ready_s, b0.start_s, b0.end_s) == pytest.approx((0.2, 0.2, 0.51))  # 0.2 + 0.01 + 0.3
    assert (b1.ready_s, b1.start_s, b1.end_s) == pytest.approx((0.5, 0.51, 0.82))  # waits for bucket 0
    assert pred.backward_s == pytest.approx(0.5)
    assert pred.exposed_s == pytest.approx(0.32)
    assert pred.comm_s == pytest.approx(0.62)
    assert pred.overlap_s == pytest.approx(0.30)
    assert pred.step_s == pytest.approx(0.05 + 0.82 + 0.02)


def test_step_overheads_by_hand():
    cost = AlphaBeta(0.0, 1000.0)
    ov = Overheads(per_bucket_s=0.01, per_tensor_s=0.002, pack_Bps=2000.0, unpack_Bps=4000.0)
    pred = simulate([0.0, 0.0], [200, 200], [[0, 1]], cost, overheads=ov)
    # 0.01 + 2 * 0.002 + 400/2000 + 400/4000 + 400/1000
    assert pred.buckets[0].end_s == pytest.approx(0.01 + 0.004 + 0.2 + 0.1 + 0.4)
    # the hooks' copies (100 B/s) delay every later gradient and the end of backward
    hooked = simulate([0.0, 1.0], [10, 20], [[0], [1]], AlphaBeta(0.0, math.inf), overheads=Overheads(hook_Bps=100.0))
    assert [b.ready_s for b in hooked.buckets] == pytest.approx([0.1, 1.3])
    assert hooked.backward_s == pytest.approx(1.3)


def test_shared_processor_by_hand():
    # backward 1 s of work, gradients ready at 0.2, 0.6, 1.0 s of it, each bucket 0.1 s of work; while
    # both run, each goes at half speed: bucket 0 runs 0.2-0.4 (backward reaches 0.3), backward alone
    # reaches 0.6 at 0.7, bucket 1 runs 0.7-0.9, backward ends at 1.2, bucket 2 runs 1.2-1.3 alone
    pred = simulate([0.2, 0.6, 1.0], [1, 1, 1], [[0], [1], [2]], lambda b: 0.1, processor="shared",
                    forward_s=0.5, update_s=0.1)
    assert [(b.ready_s, b.start_s, b.end_s) for b in pred.buckets] == [
        pytest.approx((0.2, 0.2, 0.4)), pytest.approx((0.7, 0.7, 0.9)), pytest.approx((1.2, 1.2, 1.3))]
    assert (pred.backward_s, pred.exposed_s, pred.overlap_s) == pytest.approx((1.2, 0.1, 0.2))
    assert pred.step_s == pytest.approx(0.5 + 1.0 + 0.3 + 0.1)  # nothing hidden: work adds up
    dedicated = simulate([0.2, 0.6, 1.0], [1, 1, 1], [[0], [1], [2]], lambda b: 0.1, forward_s=0.5, update_s=0.1)
    assert dedicated.step_s == pytest.approx(0.5 + 1.1 + 0.1)
    with pytest.raises(ValueError, match="processor='gpu'"):
        simulate([0.1], [1], [[0]], lambda b: 0.1, processor="gpu")


def test_simulate_refuses_plans_that_lose_or_repeat_gradients():
    cost = AlphaBeta(0.0, 1e9)
    with pytest.raises(ValueError, match="exactly once"):
        simulate([0.0, 0.1], [4, 4], [[0]], cost)
    with pytest.raises(ValueError, match="exactly once"):
        simulate([0.0, 0.1], [4, 4], [[0, 1], [1]], cost)
    with pytest.raises(ValueError, match="one ready time per gradient"):
        simulate([0.0], [4, 4], [[0, 1]], cost)


def test_no_communication_on_one_rank_means_no_loss():
    prof = Profile("m", 8, ["a", "b"], [400, 800], [0.2, 0.1], 0.1, 0.3, 0.05)
    pred = predict_step(prof, ring_allreduce(1, 1e-5, 1e9))
    assert pred.step.step_s == pytest.approx(prof.step_s)
    assert scaling_efficiency(prof.step_s, pred.step.step_s) == pytest.approx(1.0)
    assert pred.samples_per_s(8, 1) == pytest.approx(8 / prof.step_s)


# -- NCCL's cost model, by hand from tuning.cc's constants ----------------------------------------------

PASCAL_25G = Cluster(gpus_per_node=4, nodes=4, intra="pci", nic_gbps=25, compute_capability=60)


def test_graph_steps_the_nic_down_to_ncclx_speed_array():
    g = graph_for(PASCAL_25G)  # 25 Gbit/s = 3.125 GB/s (mbps / 8000); fastest step <= that: 3.0
    assert (g.channels, g.bw_inter, g.nvlink) == (1, 3.0, False)
    dgx = graph_for(Cluster(gpus_per_node=8, nodes=2, intra="nvlink", nvlinks=6, nic_gbps=100, nics_per_node=4))
    assert (dgx.channels, dgx.bw_inter) == (4, 12.0)  # 12.5 GB/s per NIC -> 12.0


def test_ring_simple_across_nodes_by_hand():
    m = NcclModel(PASCAL_25G)
    # base 8.4 + (2*15 - 2*3) steps * PCI 5.7 + 2*3 net steps * 14.0 (net overhead 3.0 < 5.7)
    assert m.latency_us("ring", "Simple") == pytest.approx(8.4 + 24 * 5.7 + 6 * 14.0)
    assert m.bandwidth_gbs("ring", "Simple") == pytest.approx(3.0 * 16 / 30)
    nbytes = 64 << 20  # large: the ring's plateau factor 1.9 below compute capability 8.0
    assert m.time_us(nbytes, "ring", "Simple") == pytest.approx(229.2 * 1.9 + nbytes / (1000 * 1.6))
    assert m.choice(nbytes) == ("ring", "Simple", pytest.approx((229.2 * 1.9 + nbytes / 1600) * 1e-6))


def test_tree_across_nodes_by_hand():
    m = NcclModel(PASCAL_25G)
    assert m.latency_us("tree", "Simple") == pytest.approx(8.4 + 2 * (3 * 4.0 + 2 * 14.0))
    assert m.bandwidth_gbs("tree", "Simple") == pytest.approx(min(3.0 * .92, 10.0) * .5)
    nbytes = 64 << 20  # log2(64 MiB / 64) = 20 -> Simple correction 0.8
    assert m.time_us(nbytes, "tree", "Simple") == pytest.approx(88.4 + nbytes / (1000 * 1.38 * 0.8))


def test_small_messages_pick_low_latency_by_hand():
    m = NcclModel(PASCAL_25G)
    # ring LL: bus min(llMaxBw Intel N4 20.4, 3.0 * .5) = 1.5 -> x16/30; latency 6.6 + 24 * 1.0 + 6 * 2.7
    assert m.time_us(4096, "ring", "LL") == pytest.approx(46.8 + 4096 / (1000 * 0.8))
    # tree LL: bus 2.76 / 3.8, x.5; latency 6.8 + 2 * (3 * 1.0 + 2 * 5.0); 4 KiB -> log 6 -> LL factor .7
    tree_bw = 2.76 / 3.8 * .5 * .7
    assert m.time_us(4096, "tree", "LL") == pytest.approx(32.8 + 4096 / (1000 * tree_bw))
    assert m.choice(4096)[:2] == ("tree", "LL")
    assert math.isinf(m.time_us(4096, "ring", "LL128"))  # LL128 needs Volta or newer over NVLink


def test_single_node_nvlink_volta_by_hand():
    m = NcclModel(Cluster(gpus_per_node=8, intra="nvlink", nvlinks=6, compute_capability=70))
    assert m.bandwidth_gbs("ring", "Simple") == pytest.approx(6 * 20.0 * 8 / 14)
    assert m.latency_us("ring", "Simple") == pytest.approx(8.4 + 14 * 3.4)
    assert m.bandwidth_gbs("ring", "LL128") == pytest.approx(min(120 * .92, 6 * 20.0) * 8 / 14)
    assert m.latency_us("ring", "LL128") == pytest.approx(14.0 + 14 * 1.9)
    nbytes = 256 << 20  # one node: no plateau factor
    assert m.time_us(nbytes, "ring", "Simple") == pytest.approx(56.0 + nbytes / (1000 * 120 * 8 / 14))


def test_512_ranks_ring_latency_by_hand():
    m = NcclModel(PASCAL_25G.with_nodes(128))
    assert m.latency_us("ring", "Simple") == pytest.approx(8.4 + 768 * 5.7 + 254 * 14.0)
    assert m.latency_us("tree", "Simple") == pytest.approx(8.4 + 2 * (3 * 4.0 + 7 * 14.0))
    g = Graph(channels=2, bw_intra=6.0, bw_inter=1.5, nvlink=False)  # an explicit graph wins
    assert NcclModel(PASCAL_25G.with_nodes(128), graphs={"ring": g}).bandwidth_gbs("ring", "Simple") == \
        pytest.approx(2 * 1.5 * 512 / 1022)


def test_nccl_model_errors_name_the_fix():
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        NcclModel(PASCAL_25G).time_s(1024, algorithm="collnet")
    with pytest.raises(ValueError, match="nvlinks >= 1"):
        Cluster(gpus_per_node=8, intra="nvlink")
    assert NcclModel(Cluster(gpus_per_node=1)).time_s(1 << 20) == 0.0


# -- the transport: NCCL's socket transport over plain TCP ------------------------------------------------


def test_socket_transport_constants_are_ncclx_own():
    from gpucomm.tuning import transport as t
    assert (t.SOCKET_MAX_THREADS, t.SOCKET_MAX_SOCKETS, t.SOCKET_MIN_TASK_BYTES, t.SOCKET_INLINE_BYTES) == \
        (16, 64, 64 * 1024, 128)
    assert t.SOCKET_DEFAULTS == {"default": (0, 1), "aws": (2, 8), "gcp": (4, 1)}
    assert (t.NCCL_BUFFSIZE, t.NCCL_STEPS, t.SOCKET_UNKNOWN_SPEED_GBPS) == (4 << 20, 8, 10.0)
    # the measured host costs: one loopback flow of a few GB/s, a fraction of a ns per byte on each side
    assert 0.5 < t.TCP_FLOW_GBS < 20 and 0.01 < t.TCP_SEND_NS_PER_BYTE < 2 and 0.01 < t.TCP_RECV_NS_PER_BYTE < 2


def test_socket_channel_limit_by_hand():
    from gpucomm.tuning.transport import Socket
    s = Socket(flow_gbs=2.0, send_ns_per_byte=0.25, recv_ns_per_byte=0.5)
    assert (s.sockets, s.streams, s.workers) == (0, 1, 1)  # NCCL's default: the proxy thread, one flow
    assert s.channel_gbs() == pytest.approx(min(2.0, 1 / 0.5))
    assert s.channel_gbs(both_directions=True) == pytest.approx(1 / 0.75)  # one thread sends and receives
    assert s.channel_gbs(channels=4) == pytest.approx(0.5)  # the proxy thread is shared by the GPU's channels
    aws = Socket.for_cloud("aws", flow_gbs=2.0, send_ns_per_byte=0.25, recv_ns_per_byte=0.5, flow_gbps=5)
    assert (aws.sockets, aws.streams, aws.workers) == (16, 16, 2)
    assert aws.channel_gbs() == pytest.approx(min(16 * 5 / 8, 2 / 0.5))  # two threads' CPU bound it
    assert aws.channel_gbs(channels=4) == aws.channel_gbs()  # helper threads are per connection
    # a 512 KiB step fills at most 8 sockets of 64 KiB tasks, 8 steps in flight at most 64
    assert Socket(threads=16, socks_per_thread=4).streams == 64
    assert Socket(threads=1, socks_per_thread=1).channel_gbs(both_directions=True) == \
        pytest.approx(min(Socket().flow_gbs, 1 / max(Socket().send_ns_per_byte, Socket().recv_ns_per_byte)))


def test_tcp_caps_each_network_channel_but_keeps_ncclx_pick():
    from gpucomm.tuning.transport import Socket
    sock = Socket(flow_gbs=1.5)
    tcp = NcclModel(Cluster(gpus_per_node=4, nodes=4, intra="pci", nic_gbps=25, compute_capability=60,
                            transport="tcp", socket=sock))
    rdma = NcclModel(PASCAL_25G)
    assert tcp.graph("ring") == rdma.graph("ring")  # NCCL's search sees the NIC either way
    assert tcp.actual_graph("ring").bw_inter == 1.5 and tcp.actual_graph("ring").bw_intra == 1.5
    assert rdma.actual_graph("ring") == rdma.graph("ring")
    nbytes = 64 << 20
    assert tcp.time_us(nbytes, "ring", "Simple") == pytest.approx(229.2 * 1.9 + nbytes / (1000 * 1.5 * 16 / 30))
    assert tcp.time_us(nbytes, "ring", "Simple", actual=False) == rdma.time_us(nbytes, "ring", "Simple")
    for size in (4096, 1 << 20, nbytes):
        assert tcp.choice(size)[:2] == rdma.choice(size)[:2]
        assert tcp.time_s(size) >= rdma.time_s(size)
    # a tree of two nodes keeps NCCL's 2x between its intra- and inter-node speeds
    two = NcclModel(Cluster(gpus_per_node=4, nodes=2, intra="pci", nic_gbps=100, compute_capability=60,
                            transport="tcp", socket=sock))
    g = two.actual_graph("tree")
    assert (g.bw_inter, g.bw_intra) == (pytest.approx(sock.channel_gbs(both_directions=True)),
                                        pytest.approx(2 * sock.channel_gbs(both_directions=True)))
    # one node has no network: the transport changes nothing
    one = Cluster(gpus_per_node=8, intra="nvlink", nvlinks=6, transport="tcp")
    assert NcclModel(one).time_s(nbytes) == NcclModel(replace(one, transport="rdma")).time_s(nbytes)
    # channels leave a node by different GPUs, each with its own proxy thread; one GPU per node shares its one
    dgx = NcclModel(Cluster(gpus_per_node=8, nodes=2, intra="nvlink", nvlinks=6, nic_gbps=100, nics_per_node=4,
                            transport="tcp", socket=sock))
    assert dgx.graph("ring").channels == 4 and dgx.socket_gbs("ring") == pytest.approx(1.5)
    alone = NcclModel(replace(dgx.cluster, gpus_per_node=1))
    assert alone.socket_gbs("ring") == pytest.approx(sock.channel_gbs(4, both_directions=True))
    assert alone.socket_gbs("ring") == pytest.approx(1 / (sock.send_ns_per_byte + sock.recv_ns_per_byte) / 4)
    # a fast enough socket transport is the NIC again
    fast = Socket.for_cloud("aws", flow_gbs=10.0)
    assert NcclModel(replace(tcp.cluster, socket=fast)).time_s(nbytes) == rdma.time_s(nbytes)


def test_transport_errors_name_the_fix():
    from gpucomm.tuning.transport import Socket
    with pytest.raises(ValueError, match="use 'rdma'"):
        Cluster(gpus_per_node=4, nodes=2, transport="udp")
    with pytest.raises(ValueError, match="MAX_THREADS"):
        Socket(threads=17)
    with pytest.raises(ValueError, match="at most 64 per connection"):
        Socket(threads=8, socks_per_thread=9)
    with pytest.raises(ValueError, match="NCCL_NSOCKS_PERTHREAD must be >= 1"):
        Socket(socks_per_thread=0)
    with pytest.raises(ValueError, match="flow_gbs=0"):
        Socket(flow_gbs=0)
    with pytest.raises(ValueError, match="must be finite"):
        Socket(send_ns_per_byte=math.inf)
    with pytest.raises(ValueError, match="NCCL auto-detects"):
        Socket.for_cloud("azure")
    with pytest.raises(ValueError, match="must be a gpucomm.tuning.transport.Socket"):
        Cluster(gpus_per_node=4, socket=(2, 8))


# -- the dynamic program against brute force -----------------------------------------------------------


def _brute_force(ready, sizes, cost, overheads, cap=None, processor="dedicated"):
    n = len(sizes)
    order = sorted(range(n), key=lambda i: (ready[i], -i))
    best = math.inf
    for mask in range(1 << (n - 1)):
        cuts = [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        buckets = buckets_from_cuts(order, cuts)
        if cap is not None and any(len(b) > 1 and sum(sizes[i] for i in b) > cap for b in buckets):
            continue
        pred = simulate(ready, sizes, buckets, cost, overheads=overheads, processor=processor)
        best = min(best, pred.buckets[-1].end_s)
    return best


def _random_instance(rng):
    n = rng.randint(1, 9)
    ready = [rng.choice([rng.uniform(0, 1.0), 0.5]) for _ in range(n)]  # some ties
    sizes = [rng.randint(0, 5) * rng.choice([1, 1000, 10 ** 6]) for _ in range(n)]
    kind = rng.randrange(3)
    if kind == 0:
        cost = AlphaBeta(rng.uniform(0, 0.2), rng.uniform(1e5, 1e8))
    elif kind == 1:
        nodes = rng.choice([1, 2, 4, 16])
        cost = NcclModel(Cluster(gpus_per_node=rng.choice([1, 4, 8]), nodes=nodes, nic_gbps=rng.choice([10, 25]),
                                 compute_capability=rng.choice([60, 70, 90]))).cost()
        sizes = [s * 1000 for s in sizes]
    else:  # not affine: a step at 2 MB
        cost = lambda b: 0.01 + (0.2 if b > 2_000_000 else 0.0) + b * 1e-8  # noqa: E731
    overheads = Overheads(per_bucket_s=rng.choice([0.0, 0.01]), per_tensor_s=rng.choice([0.0, 0.003]),
                          hook_Bps=rng.choice([math.inf, 1e8]))
    return ready, sizes, cost, overheads


@pytest.mark.parametrize("seed", range(60))
def test_dynamic_program_matches_brute_force(seed):
    rng = random.Random(seed)
    ready, sizes, cost, overheads = _random_instance(rng)
    plan = optimal_plan(ready, sizes, cost, overheads=overheads)
    best = _brute_force(ready, sizes, cost, overheads)
    assert plan.end_s == pytest.approx(best, rel=1e-12, abs=1e-12)
    replay = simulate(ready, sizes, [list(b) for b in plan.buckets], cost, overheads=overheads)
    assert replay.buckets[-1].end_s == pytest.approx(plan.end_s, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_dynamic_program_on_a_shared_processor_matches_brute_force(seed):
    rng = random.Random(500 + seed)
    ready, sizes, cost, overheads = _random_instance(rng)
    plan = optimal_plan(ready, sizes, cost, overheads=overheads, processor="shared")
    assert plan.end_s == pytest.approx(_brute_force(ready, sizes, cost, overheads, processor="shared"),
                                       rel=1e-9, abs=1e-12)
    replay = simulate(ready, sizes, [list(b) for b in plan.buckets], cost, overheads=overheads, processor="shared")
    assert replay.buckets[-1].end_s == pytest.approx(plan.end_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_program_with_a_cap_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    ready, sizes, cost, overheads = _random_instance(rng)
    cap = rng.choice([1, 3, 4000, 2_000_000])
    plan = optimal_plan(ready, sizes, cost, overheads=overheads, cap_bytes=cap)
    assert all(len(b) == 1 or sum(sizes[i] for i in b) <= cap for b in plan.buckets)
    assert plan.end_s == pytest.approx(_brute_force(ready, sizes, cost, overheads, cap), rel=1e-12, abs=1e-12)


def test_dynamic_program_trades_latency_against_waiting():
    # high latency: one bucket; no latency: every gradient alone, as soon as it is ready
    ready, sizes = [0.1, 0.2, 0.3, 0.4], [100] * 4
    assert len(optimal_plan(ready, sizes, AlphaBeta(1.0, 1e6)).buckets) == 1
    assert len(optimal_plan(ready, sizes, AlphaBeta(0.0, 1e3)).buckets) == 4


# -- other systems' plans ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_capped_buckets_follow_gpucomms_planner(seed):
    rng = random.Random(seed)
    numels = [rng.choice([1, 1000, 50_000, 300_000, 2_000_000]) for _ in range(rng.randint(1, 30))]
    params = [torch.empty(n, device="meta") for n in numels]
    theirs = [list(b.param_indices) for b in plan_buckets(params, first_bucket_bytes=1 << 20,
                                                          bucket_cap_bytes=4 << 20, env={})]
    assert capped_buckets([4 * n for n in numels], first_bytes=1 << 20, cap_bytes=4 << 20) == theirs


def test_ddp_rule_keeps_the_crossing_gradient():
    # reverse order: 3, 2, 1, 0; first limit 10: 3 (6) + 2 (6) = 12 >= 10 closes; then limit 20
    assert capped_buckets([15, 6, 6, 6], first_bytes=10, cap_bytes=20, rule="ddp") == [[3, 2], [1, 0]]
    assert capped_buckets([15, 6, 6, 6], first_bytes=10, cap_bytes=20) == [[3], [2, 1], [0]]


def test_horovod_cycle_by_hand():
    # 5 ms cycles; gradients ready at 1 ms and 12 ms; each allreduce 2 ms
    pred = cycle_schedule([0.001, 0.012], [10, 10], lambda b: 0.002, cycle_s=0.005)
    assert [(b.start_s, b.end_s) for b in pred.buckets] == [pytest.approx((0.005, 0.007)),
                                                            pytest.approx((0.012, 0.014))]
    assert pred.exposed_s == pytest.approx(0.002)
    # both ready in one cycle: fused up to the threshold, in ready order
    fused = cycle_schedule([0.001, 0.002, 0.003], [40, 40, 40], lambda b: 0.001, cycle_s=0.005, threshold_bytes=80)
    assert [b.ntensors for b in fused.buckets] == [2, 1]


# -- profiles and plans ------------------------------------------------------------------------------------


def test_profile_round_trips_and_scales(tmp_path):
    prof = Profile("m", 4, ["a", "b"], [8, 16], [0.2, 0.1], 0.1, 0.3, 0.1, source="hand")
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = Profile.load(str(path))
    assert back == prof
    half = prof.scaled(0.25)
    assert half.step_s == pytest.approx(0.25) and half.ready_s == pytest.approx([0.1, 0.05])
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        Profile.load(str(path))
    with pytest.raises(ValueError, match="one of each per parameter"):
        Profile("m", 4, ["a"], [8, 16], [0.2], 0.1, 0.3)


def test_analytic_profile_by_hand():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
    # flops: 2*B*10*20 = 1600 and 2*B*20*5 = 800 (B=4); at 1 flop/s the bytes (100 TB/s) never bind
    prof = analytic_profile(model, (10,), 4, name="mlp", flops_per_s=1.0, bytes_per_s=1e14)
    assert prof.forward_s == pytest.approx(2400, rel=1e-6)
    # backward: the last layer first (2x800), the ReLU (bytes only), the first layer (no input gradient: 1x1600)
    ready = dict(zip(prof.names, prof.ready_s))
    assert ready["2.weight"] == pytest.approx(1600, rel=1e-6) and ready["2.bias"] == ready["2.weight"]
    assert ready["0.weight"] == pytest.approx(3200, rel=1e-6) and prof.backward_s == pytest.approx(3200, rel=1e-6)
    assert prof.sizes == [800, 80, 400, 20]


# -- the wait for the slowest rank ------------------------------------------------------------------


def test_expected_max_normal_against_closed_forms_and_tables():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-8)  # E[max(z1, z2)]
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-8)
    # published values of the expected largest of n standard normals (e.g. Harter 1961): 1.02938, 1.53875
    assert expected_max_normal(4) == pytest.approx(1.029375, abs=1e-6)
    assert expected_max_normal(10) == pytest.approx(1.538753, abs=1e-6)
    # a Monte Carlo estimate agrees at a rank count with no closed form
    rng = random.Random(3)
    draws = [max(rng.gauss(0, 1) for _ in range(64)) for _ in range(4000)]
    assert expected_max_normal(64) == pytest.approx(sum(draws) / len(draws), abs=0.03)
    values = [expected_max_normal(n) for n in (2, 4, 16, 128, 512)]
    assert values == sorted(values) and values[-1] < math.sqrt(2 * math.log(512))
    with pytest.raises(ValueError, match="ranks >= 1"):
        expected_max_normal(0)


def test_stragglers_delay_and_fit():
    s = Stragglers(0.04)
    assert s.delay_s(0.5, 1) == 0.0
    assert s.delay_s(0.5, 16) == pytest.approx(0.04 * 0.5 * expected_max_normal(16))
    with pytest.raises(ValueError, match="fraction >= 0"):
        Stragglers(-0.01)
    # rows made with a known cv come back to it, whatever the communication part of each row
    cv = 0.037
    rows = [(r, n, 1 / (r + cv * expected_max_normal(n))) for r, n in ((1.0, 16), (1.08, 16), (1.2, 128), (1.0, 512))]
    assert fit_cv(rows) == pytest.approx(cv, rel=1e-9)
    # a model already slower than published: no negative noise
    assert fit_cv([(1.3, 16, 0.9)]) == 0.0
    with pytest.raises(ValueError, match="more than one rank"):
        fit_cv([(1.0, 1, 1.0)])
    with pytest.raises(ValueError, match="efficiency"):
        fit_cv([(1.0, 16, 0.0)])


def test_plans_become_fusion_buckets_and_groups():
    params = [torch.zeros(3), torch.zeros(5), torch.zeros(2)]
    buckets = to_fusion_buckets(params, [[2, 1], [0]])
    assert [(b.index, b.param_indices, b.offsets, b.numel) for b in buckets] == [(0, (2, 1), (0, 2), 7),
                                                                                (1, (0,), (0,), 3)]
    assert [[id(p) for p in g] for g in to_groups(params, [[2, 1], [0]])] == [[id(params[2]), id(params[1])],
                                                                            [id(params[0])]]
    with pytest.raises(ValueError, match="exactly once"):
        to_groups(params, [[0, 1]])
    with pytest.raises(ValueError, match="mixes dtypes"):
        to_fusion_buckets([torch.zeros(1), torch.zeros(1, dtype=torch.float64)], [[0, 1]])


def test_the_model_core_imports_no_torch():
    r = run([PYTHON, "-c", "import sys, gpucomm.tuning; print('torch' in sys.modules)"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_measured_curve_follows_the_samples_and_carries_the_last_slope_on():
    from gpucomm.tuning.costs import MeasuredCurve

    curve = MeasuredCurve.from_samples([(1 << 20, 0.004), (16 << 20, 0.011), (32 << 20, 0.026), (1 << 20, 0.002),
                                        (1 << 20, 0.003), (16 << 20, 0.012), (16 << 20, 0.010)])
    assert curve.points == ((float(1 << 20), 0.003), (float(16 << 20), 0.011), (float(32 << 20), 0.026))  # medians
    assert curve(1 << 20) == 0.003 and curve(4096) == 0.003  # below the smallest size: its time
    assert curve(24 << 20) == pytest.approx(0.0185)  # halfway between 16 and 32 MiB
    assert curve(48 << 20) == pytest.approx(0.041)  # the last segment's 15 ms per 16 MiB, carried on
    assert curve.to_dict() == {"points": [[float(1 << 20), 0.003], [float(16 << 20), 0.011], [float(32 << 20), 0.026]]}
    for bad in ([(1 << 20, 0.003)], [(1 << 20, 0.003), (1 << 20, 0.004)], [(1, 0.0), (2, 1.0)]):
        with pytest.raises(ValueError, match="MeasuredCurve"):
            MeasuredCurve(tuple(bad))
