"""The NCCL transport parser on recorded NCCL_DEBUG=INFO lines."""

from ops.actions import nccl

# The baseline's three sample lines (8 x L4 over two g6.12xlarge nodes, EFA), as the log shows them.
SEED = [
    "gpu-node-02:51823:51890 [2] NCCL INFO Channel 00 : 6[2] -> 7[3] via SHM/direct/direct",
    "gpu-node-02:51824:51891 [3] NCCL INFO Channel 00/0 : 7[3] -> 0[0] [send] via NET/Libfabric/0",
    "gpu-node-02:51824:51888 [3] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 1 nics)",
]

# A fuller 2 x 2 ring on EFA as srun -l writes it (label prefix), with the receive side of each
# NET link, the P2P path of an NVLink box and the noise NCCL prints around them.
EFA_RUN = """\
0: gpu-node-01:7001:7060 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
0: gpu-node-01:7001:7060 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v8)
0: gpu-node-01:7001:7060 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 4 nics)
0: gpu-node-01:7001:7060 [0] NCCL INFO Using network Libfabric
2: gpu-node-02:8001:8060 [0] NCCL INFO Using network Libfabric
0: gpu-node-01:7001:7060 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
0: gpu-node-01:7002:7061 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Libfabric/0/GDRDMA
2: gpu-node-02:8001:8060 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/Libfabric/0/GDRDMA
2: gpu-node-02:8001:8060 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[1] via P2P/IPC
2: gpu-node-02:8002:8062 [1] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [send] via NET/Libfabric/0/GDRDMA
0: gpu-node-01:7001:7060 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
0: gpu-node-01:7001:7060 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
0: gpu-node-01:7001:7060 [0] NCCL INFO Connected all rings
0: gpu-node-01:7001:7060 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
""".splitlines()

# TCP fallback: the EFA plugin was not found, NCCL used plain sockets between nodes.
SOCKET_RUN = """\
gpu-node-01:900:950 [0] NCCL INFO NET/Socket : Using [0]ens5:10.213.0.11<0>
gpu-node-01:900:950 [0] NCCL INFO Using network Socket
gpu-node-01:900:950 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
gpu-node-01:901:951 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/0
gpu-node-02:902:952 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[1] via SHM/direct/direct
gpu-node-02:903:953 [1] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [send] via NET/Socket/0
gpu-node-02:903:953 [1] NCCL INFO Channel 01/1 : 3[1] -> 0[0] [send] via NET/Socket/1
""".splitlines()


def test_seed_lines():
    pic = nccl.parse(SEED)
    assert pic.intra == {"SHM": 1}
    assert pic.inter == {"NET/Libfabric": 1}
    assert pic.providers == {"efa"}
    text = pic.describe()
    assert "1 links inside a node (SHM 1)" in text and "1 across nodes (NET/Libfabric 1)" in text
    assert "provider efa" in text


def test_send_and_receive_count_once_and_p2p_kinds():
    pic = nccl.parse(EFA_RUN)
    # ring: 0->1, 2->3 (P2P/IPC), 0->1 on channel 1 (P2P/CUMEM); NET: 1->2, 3->0 once each
    assert pic.intra == {"P2P/IPC": 2, "P2P/CUMEM": 1}
    assert pic.inter == {"NET/Libfabric": 2}
    assert pic.networks == {"Libfabric"} and pic.providers == {"efa"}
    assert pic.intra_links == 3 and pic.inter_links == 2
    assert pic.warnings(expect_efa=True) == []


def test_socket_fallback_is_flagged_on_aws():
    pic = nccl.parse(SOCKET_RUN)
    assert pic.intra == {"SHM": 2}
    assert pic.inter == {"NET/Socket": 3}
    assert pic.networks == {"Socket"} and not pic.providers
    warnings = pic.warnings(expect_efa=True)
    assert any("TCP sockets" in w for w in warnings)
    assert any("NET/OFI" in w for w in warnings)
    assert pic.warnings(expect_efa=False) == []


def test_aws_libfabric_name_with_space():
    line = "3: n2:1:2 [3] NCCL INFO Channel 02/0 : 7[3] -> 0[0] [send] via NET/AWS Libfabric/0/GDRDMA"
    assert nccl.parse([line]).inter == {"NET/AWS Libfabric": 1}


def test_no_nccl_lines_says_so():
    pic = nccl.parse(["0: {'loss': '2.1', 'epoch': '0.1'}", "gloo rendezvous done"])
    assert pic.lines == 0
    assert "no NCCL lines" in pic.describe() and "gloo" in pic.describe()
    assert pic.warnings(expect_efa=True) == []
