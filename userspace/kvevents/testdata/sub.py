# A subscriber and replay client on real libzmq for interop_test.go: reads
# three messages from the fake publisher (tether's own PUB), then asks its
# ROUTER for a replay from seq 1 with a DEALER, and prints what it got.
import struct
import sys

import msgpack
import zmq

ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
print("CONNECTED", flush=True)
for _ in range(3):
    topic, seq, payload = sub.recv_multipart()
    b = msgpack.unpackb(payload, raw=False)
    print("MSG", struct.unpack(">Q", seq)[0], len(b[1]), b[1][0][0] if isinstance(b[1][0], list) else b[1][0]["type"], flush=True)
dealer = ctx.socket(zmq.DEALER)
dealer.connect(sys.argv[2])
dealer.send_multipart([b"", struct.pack(">Q", 1)])
while True:
    frames = dealer.recv_multipart()
    seq = struct.unpack(">q", frames[-2])[0]
    print("REPLAY", seq, flush=True)
    if seq == -1:
        break
