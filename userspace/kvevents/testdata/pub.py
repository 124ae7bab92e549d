# A KV-event publisher on real libzmq (python3-zmq) for interop_test.go:
# XPUB (a PUB that also shows the subscriptions) and a replay ROUTER as
# vLLM's ZmqEventPublisher serves them. It prints its ports, waits for a
# subscription, publishes seqs 0, 1 and 3 (2 only kept for replay), and
# answers replay requests until stdin closes.
import os
import select
import struct
import sys

import msgpack
import zmq

topic_in_replies = len(sys.argv) > 1 and sys.argv[1] == "topic"
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
router_port = router.bind_to_random_port("tcp://127.0.0.1")
print("READY", pub_port, router_port, flush=True)

sub = pub.recv()  # b"\x01" + topic
assert sub[:1] == b"\x01", sub

digest = bytes(24) + struct.pack(">Q", 0x0100000000000007)
batches = [
    [1.0, [["BlockStored", [2**63 + 5], None, [1, 2, 3, 4], 2, None, "GPU"]], None],
    [2.0, [{"type": "BlockStored", "block_hashes": [-3], "parent_block_hash": None,
            "token_ids": [5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": None, "group_idx": 0}], 0],
    [3.0, [{"type": "BlockRemoved", "block_hashes": [-3], "medium": "GPU"}], 0],
    [4.0, [{"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": digest,
            "token_ids": [7, 8], "block_size": 2}, ["AllBlocksCleared"]], 1],
]
payloads = [msgpack.packb(b, use_bin_type=True) for b in batches]
topic = b"kv@test"
for seq, p in enumerate(payloads):
    if seq == 2:
        continue
    pub.send_multipart([topic, struct.pack(">Q", seq), p])

poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
while True:
    r, _, _ = select.select([sys.stdin], [], [], 0)
    if r and not sys.stdin.read(1):
        break
    if not poller.poll(50):
        continue
    frames = router.recv_multipart()
    ident, start = frames[0], struct.unpack(">Q", frames[-1])[0]
    for seq, p in enumerate(payloads):
        if seq >= start:
            head = [ident, b""] + ([topic] if topic_in_replies else [])
            router.send_multipart(head + [struct.pack(">Q", seq), p])
    head = [ident, b""] + ([topic] if topic_in_replies else [])
    router.send_multipart(head + [struct.pack(">q", -1), b""])
    print("REPLAYED", start, flush=True)
