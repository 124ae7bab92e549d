/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * tether.h: the layouts shared by the BPF program (bpf/steer.c) and Go
 * (userspace/stats, bpf/). Every struct here is read or written from both
 * sides, so field order, sizes and padding are part of the map ABI: change
 * them only together with TETHER_ABI_VERSION, which names the bpffs pin
 * directory (/sys/fs/bpf/tether/v<N>) so that an incompatible layout never
 * reuses maps pinned by an older tetherd.
 */
#ifndef TETHER_H
#define TETHER_H

#include <linux/types.h>

#define TETHER_ABI_VERSION 1

/* Listener slots in the SO_REUSEPORT group (size of the sockarray). */
#define TETHER_MAX_SLOTS 64
/* Backend worker slots: the <idx> in a w<idx>-<uuid> session id. */
#define TETHER_MAX_WORKERS 1024
/* Entries in the sticky routing table (LRU). */
#define TETHER_MAX_STICKY 65536

/* Largest slot weight: keeps active * weight products far from overflow. */
#define TETHER_MAX_WEIGHT 65535

/* State of a listener slot, written by the control plane. */
enum tether_slot_state {
	TETHER_SLOT_EMPTY = 0,    /* no socket: never selected */
	TETHER_SLOT_ACTIVE = 1,   /* accepting: eligible for new connections */
	TETHER_SLOT_DRAINING = 2, /* being retired: no new connections */
};

/* slot_table[slot]: what the control plane wants of a listener slot. */
struct tether_slot {
	__u32 state;  /* enum tether_slot_state */
	__u32 weight; /* relative capacity, 0 treated as 1, capped at TETHER_MAX_WEIGHT */
};

/*
 * slot_load[slot]: live load of a listener, written (atomically, through an
 * mmap of the BPF_F_MMAPABLE array) by the tetherd goroutines that own the
 * slot, and by the program (pending, steered, steer_load). One cache line
 * each: no false sharing.
 *
 * The program balances on steer_load = active + pending, kept as a word of
 * its own. pending counts the connections the program steered here (on
 * their SYN, or when it migrated them here) that tetherd has not accepted
 * yet, so that a burst of SYNs decided before any accept sees its own
 * earlier decisions. One word, because an accept moves a connection from
 * pending to active, which in two words the program could read half done
 * (a slot looking one lighter or heavier than it is); steer_load does not
 * change on accept.
 *
 * Writers: the program raises steer_load with a compare-and-swap against
 * the value it chose on, and pending and steered with it (steer.c).
 * tetherd, on accept (stats.Slot.Opened), takes one off pending, or, when
 * none is left (a connection the program did not count), adds one to
 * steer_load; on close it takes one off steer_load; neither goes below 0.
 * Its listener watcher takes off pending and steer_load what can no longer
 * be accepted (SYNs whose handshake never completed).
 *
 * pending, steered and steer_load were taken from _pad, which older
 * tetherds never wrote (zero), and a slot is reset when a listener is
 * inserted: maps pinned by either version work with the other, so the ABI
 * version did not change. Only add fields that way when zero means
 * "nothing" to older and newer code alike.
 */
struct tether_slot_load {
	__u64 active;     /* connections accepted and not yet closed */
	__u64 accepted;   /* connections accepted, ever */
	__u64 closed;     /* connections closed, ever */
	__u64 pending;    /* steered here by the program, not yet accepted */
	__u64 steered;    /* connections the program counted pending here, ever */
	__u64 steer_load; /* active + pending, one word: what the program balances */
	__u64 _pad[2];
};

/*
 * worker_stats[worker slot]: per-backend counters, written atomically by the
 * data plane through an mmap of the BPF_F_MMAPABLE array, read by tetherctl,
 * the Prometheus collector and the placement code. One cache line each.
 */
struct tether_worker_stats {
	__u64 in_flight;  /* requests sent and not yet fully answered */
	__u64 requests;   /* requests routed to this worker, ever */
	__u64 errors;     /* requests that ended in a proxy error (502/504, truncation) */
	__u64 bytes_up;   /* body and head bytes relayed client -> worker */
	__u64 bytes_down; /* body and head bytes relayed worker -> client */
	__u64 retries;    /* connect retries and dead pooled connections replaced */
	__u64 conns;      /* upstream connections open now */
	__u64 _pad;
};

/* Indexes into the per-CPU decision_counters array. */
enum tether_decision {
	TETHER_DECISION_SELECTED = 0,          /* + slot: selected per slot, [0, TETHER_MAX_SLOTS) */
	TETHER_DECISION_MIGRATED = TETHER_MAX_SLOTS, /* queued connection migrated off a closing listener */
	TETHER_DECISION_FALLBACK_NO_SLOT,      /* no active slot: kernel hash */
	TETHER_DECISION_FALLBACK_SELECT_ERR,   /* bpf_sk_select_reuseport failed twice: kernel hash */
	TETHER_DECISION_MIGRATED_TO,           /* + slot: migrations steered to each slot */
	TETHER_DECISION_MAX = TETHER_DECISION_MIGRATED_TO + TETHER_MAX_SLOTS,
};

/*
 * sticky_sessions: key hash -> owning worker, LRU-evicted. Keys are routing
 * key hashes (--policy=sticky assignments, --policy=hash spills) and, in a
 * hash domain of their own, learned bare session ids.
 *
 * worker_id was _pad, which older tetherds wrote as zero: an entry with
 * worker_id 0 matches no worker (it is treated as expired), and older
 * tetherds ignore the field, so the ABI version did not change.
 */
struct tether_sticky {
	__u32 worker;     /* worker slot when stored */
	__u32 worker_id;  /* identity of the worker (hash of its URL), never 0 */
	__u64 expires_ns; /* CLOCK_MONOTONIC (bpf_ktime_get_ns) deadline */
};

#endif /* TETHER_H */
