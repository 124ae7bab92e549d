// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * redirect.c: the local-worker kernel assist (tetherd --sockmap=on), an
 * experiment measured in make bench (target tetherd-sockmap).
 *
 * For a worker on this host, the bytes tetherd writes to its upstream
 * socket need not cross the TCP/IP stack twice (tetherd's transmit and the
 * worker's receive, both over loopback): an sk_msg program on tetherd's
 * socket can put them straight into the worker's socket's receive queue.
 *
 *   worker_socks: the worker's ends of loopback connections to the ports
 *     in worker_ports, added by tether_sockops when the handshake
 *     completes on the worker's side (PASSIVE_ESTABLISHED).
 *   upstream_socks: tetherd's ends, added by tetherd itself (bpf.Redirect
 *     .Add) once connected and before its first byte, and only when its
 *     peer is already in worker_socks: a socket is redirected from its
 *     first byte to its last, or never, so the worker never reads redirected
 *     bytes ahead of bytes that took the stack.
 *   tether_redirect (sk_msg, attached to upstream_socks) runs for every
 *     write on those sockets.
 *
 * Only one direction is redirected. The worker's answers take the stack as
 * before: tetherd reads them with read(2) and splice(2), and splice does not
 * see bytes an sk_msg program redirected into a socket (they wait in the
 * psock's queue, which only recvmsg reads).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "../headers/tether.h"

/* The worker's ends, by their own four-tuple. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct tether_sock_key);
	__type(value, __u64); /* a socket cookie when read from userspace */
} worker_socks SEC(".maps");

/* tetherd's ends, by their own four-tuple. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct tether_sock_key);
	__type(value, __u64);
} upstream_socks SEC(".maps");

/* Loopback ports workers listen on (host byte order); value unused. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, TETHER_MAX_WORKERS);
	__type(key, __u32);
	__type(value, __u8);
} worker_ports SEC(".maps");

SEC("sockops")
int tether_sockops(struct bpf_sock_ops *skops)
{
	/* The return value of a sockops program only matters for the ops
	 * that ask for one (none here): 1 is "no opinion". */
	if (skops->family != 2 /* AF_INET */ || skops->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	__u32 lport = skops->local_port;
	if (!bpf_map_lookup_elem(&worker_ports, &lport))
		return 1;
	/* Loopback peers only: a remote client of the worker is no
	 * tetherd of this host. */
	if ((bpf_ntohl(skops->remote_ip4) >> 24) != 127)
		return 1;
	struct tether_sock_key k = {
		.local_ip4 = skops->local_ip4,
		.remote_ip4 = skops->remote_ip4,
		.local_port = lport,
		.remote_port = bpf_ntohl(skops->remote_port),
	};
	/* A failure (the map full) leaves the connection on the stack:
	 * tetherd then finds no peer and does not redirect it. */
	bpf_sock_hash_update(skops, &worker_socks, &k, BPF_NOEXIST);
	return 1;
}

SEC("sk_msg")
int tether_redirect(struct sk_msg_md *msg)
{
	struct tether_sock_key peer = {
		.local_ip4 = msg->remote_ip4,
		.remote_ip4 = msg->local_ip4,
		.local_port = bpf_ntohl(msg->remote_port),
		.remote_port = msg->local_port,
	};
	/* SK_PASS with the bytes queued on the peer's receive side; SK_DROP
	 * (the write fails with EACCES) when the peer is gone from
	 * worker_socks, that is closed: a write to a closed peer fails on
	 * the stack too. */
	return bpf_msg_redirect_hash(msg, &worker_socks, &peer, BPF_F_INGRESS);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
