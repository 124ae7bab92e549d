// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * steer.c: tether's SO_REUSEPORT steering program.
 *
 * tetherd opens K listening sockets in one SO_REUSEPORT group and puts each
 * into listener_sockets[slot]. The kernel runs this program for every new
 * connection (the SYN, or the final ACK with syncookies) to choose the
 * listener, and, because it is attached as
 * BPF_SK_REUSEPORT_SELECT_OR_MIGRATE, also for every queued connection of a
 * listener that closes (ctx->migrating_sk set), to choose where it moves.
 *
 * Selection (weighted, two random choices):
 *   1. Walk the ACTIVE slots of slot_table: total active connections A and
 *      total weight W (slot_load is written by tetherd through mmap).
 *   2. Keep the slots whose normalized load is at most the average,
 *      active_i / w_i <= A / W, and draw two distinct ones uniformly at random
 *      among them (reservoir sampling, bpf_get_prandom_u32).
 *   3. Of the two, take the less loaded (active_a * w_b vs active_b * w_a),
 *      a coin flip on a tie.
 * Drawing among the below-average slots rather than among all active slots
 * is what keeps the spread tight: with plain two choices over all slots, 64
 * connections opened one by one over 8 listeners end with a 9 on some
 * listener in ~91% of runs (max/mean 1.125); restricted to below-average
 * slots no listener ever gets above ceil(mean). It keeps the point of two
 * random choices: a burst decided on one (stale) view of the load spreads
 * over the below-average slots instead of all landing on the single least
 * loaded one. See docs/bpf.md.
 *
 * The slots are found by walking slot_table (bpf_loop over TETHER_MAX_SLOTS,
 * twice): array lookups are cheap, the walk runs once per new connection
 * (not per packet), and there is no second, derived "active list" for
 * userspace to keep consistent with slot_table.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "../headers/tether.h"

char _license[] SEC("license") = "Dual BSD/GPL";

/* The listening sockets, by slot. Value: socket fd on update, cookie on read. */
struct {
	__uint(type, BPF_MAP_TYPE_REUSEPORT_SOCKARRAY);
	__uint(max_entries, TETHER_MAX_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} listener_sockets SEC(".maps");

/* What the control plane wants of each slot: state and weight. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, TETHER_MAX_SLOTS);
	__type(key, __u32);
	__type(value, struct tether_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} slot_table SEC(".maps");

/* Live load of each slot, written by tetherd through an mmap. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, TETHER_MAX_SLOTS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct tether_slot_load);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} slot_load SEC(".maps");

/* What the program decided, per CPU, indexed by enum tether_decision. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, TETHER_DECISION_MAX);
	__type(key, enum tether_decision);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} decision_counters SEC(".maps");

/*
 * Per-backend counters of the data plane. Not used here: defined in the
 * object so that it is created and pinned together with the other maps.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, TETHER_MAX_WORKERS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct tether_worker_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} worker_stats SEC(".maps");

/* Routing key hash -> owning worker, for the routing policies (not used yet). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, TETHER_MAX_STICKY);
	__type(key, __u64);
	__type(value, struct tether_sticky);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sticky_sessions SEC(".maps");

static __always_inline void count(__u32 decision)
{
	__u64 *v = bpf_map_lookup_elem(&decision_counters, &decision);

	if (v)
		*v += 1; /* per-CPU slot: no atomic needed */
}

/* weight of an active slot: 0 means 1, capped so products stay in range. */
static __always_inline __u64 slot_weight(const struct tether_slot *s)
{
	__u32 w = s->weight;

	if (w == 0)
		return 1;
	if (w > TETHER_MAX_WEIGHT)
		return TETHER_MAX_WEIGHT;
	return w;
}

static __always_inline __u64 slot_active(__u32 i)
{
	struct tether_slot_load *l = bpf_map_lookup_elem(&slot_load, &i);

	/* Written concurrently by userspace atomics: one aligned 64-bit load. */
	return l ? *(volatile __u64 *)&l->active : 0;
}

static __always_inline const struct tether_slot *active_slot(__u32 i)
{
	const struct tether_slot *s = bpf_map_lookup_elem(&slot_table, &i);

	if (!s || s->state != TETHER_SLOT_ACTIVE)
		return 0;
	return s;
}

/* The two candidate slots; b is NO_SLOT when only one slot qualified. */
#define NO_SLOT ((__u32)-1)
struct choice {
	__u64 total_active, total_weight; /* over the active slots */
	__u32 seen;                       /* slots at or below the average so far */
	__u32 a, b;
	__u64 load_a, load_b; /* active connections */
	__u64 w_a, w_b;       /* weights */
};

/* bpf_loop callback, pass 1: totals over the active slots. */
static long add_slot(__u32 i, void *arg)
{
	struct choice *c = arg;
	const struct tether_slot *s = active_slot(i);

	if (s) {
		c->total_active += slot_active(i);
		c->total_weight += slot_weight(s);
	}
	return 0;
}

/*
 * bpf_loop callback, pass 2: two distinct random slots among those at or
 * below the weighted average (reservoir sampling of size 2).
 */
static long sample_slot(__u32 i, void *arg)
{
	struct choice *c = arg;
	const struct tether_slot *s = active_slot(i);
	__u64 load, w;

	if (!s)
		return 0;
	load = slot_active(i);
	w = slot_weight(s);
	if (load * c->total_weight > c->total_active * w)
		return 0; /* above average */
	c->seen++;
	if (c->seen == 1) {
		c->a = i, c->load_a = load, c->w_a = w;
	} else if (c->seen == 2) {
		c->b = i, c->load_b = load, c->w_b = w;
	} else {
		__u32 r = bpf_get_prandom_u32() % c->seen;

		if (r == 0)
			c->a = i, c->load_a = load, c->w_a = w;
		else if (r == 1)
			c->b = i, c->load_b = load, c->w_b = w;
	}
	return 0;
}

/*
 * Fills c, the better candidate in c->a; returns 0 when there is no active
 * slot. The walks use bpf_loop so that the verifier checks each callback
 * once instead of unrolling TETHER_MAX_SLOTS iterations of branches.
 */
static __always_inline int choose(struct choice *c)
{
	c->a = NO_SLOT;
	c->b = NO_SLOT;
	bpf_loop(TETHER_MAX_SLOTS, add_slot, c, 0);
	if (c->total_weight == 0)
		return 0;
	/*
	 * At least one active slot is always at or below the average, unless
	 * slot_table or slot_load changed between the passes: then a may stay
	 * NO_SLOT.
	 */
	bpf_loop(TETHER_MAX_SLOTS, sample_slot, c, 0);
	if (c->a == NO_SLOT)
		return 0;
	if (c->b == NO_SLOT)
		return 1;

	/* The less loaded first: load_b/w_b < load_a/w_a, or a coin flip on a tie. */
	__u64 la = c->load_a * c->w_b, lb = c->load_b * c->w_a;
	if (lb < la || (lb == la && (bpf_get_prandom_u32() & 1))) {
		__u32 t = c->a;
		__u64 tl = c->load_a, tw = c->w_a;

		c->a = c->b, c->load_a = c->load_b, c->w_a = c->w_b;
		c->b = t, c->load_b = tl, c->w_b = tw;
	}
	return 1;
}

/*
 * Every path returns SK_PASS, with or without a selection. SK_DROP is never
 * returned: for a new connection it would drop the SYN (the client retries a
 * second later), for a migration it would reset a connection the client
 * already completed.
 */
SEC("sk_reuseport/migrate")
int tether_steer(struct sk_reuseport_md *ctx)
{
	__u32 base = ctx->migrating_sk ? TETHER_DECISION_MIGRATED_TO : TETHER_DECISION_SELECTED;
	struct choice c = {};
	__u32 key;

	if (!choose(&c)) {
		/*
		 * SK_PASS without a selection: no slot is active (tetherd is
		 * starting, stopping, or every listener is draining), so let the
		 * kernel pick by hash among the sockets still in the group
		 * rather than refuse the connection. For a migration the kernel
		 * hashes among the remaining listeners, so it still moves.
		 */
		count(TETHER_DECISION_FALLBACK_NO_SLOT);
		return SK_PASS;
	}

	key = c.a;
	if (bpf_sk_select_reuseport(ctx, &listener_sockets, &key, 0) == 0)
		goto selected;
	/*
	 * The preferred slot has no usable socket (closed a moment ago and not
	 * yet marked in slot_table, or not in this group): try the other one.
	 */
	if (c.b != NO_SLOT) {
		key = c.b;
		if (bpf_sk_select_reuseport(ctx, &listener_sockets, &key, 0) == 0)
			goto selected;
	}
	/*
	 * SK_PASS without a selection: both choices failed, so fall back to
	 * the kernel's hash over the group; a connection is never dropped
	 * because of stale steering state.
	 */
	count(TETHER_DECISION_FALLBACK_SELECT_ERR);
	return SK_PASS;

selected:
	if (key < TETHER_MAX_SLOTS)
		count(base + key);
	if (ctx->migrating_sk)
		count(TETHER_DECISION_MIGRATED);
	/* SK_PASS with a selection: the kernel uses the selected socket. */
	return SK_PASS;
}
