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
 *   1. Walk the ACTIVE slots of slot_table: total load A and total weight
 *      W. A slot's load (slot_load.steer_load) is active + pending:
 *      connections tetherd accepted and has not closed, plus connections
 *      this program steered there that tetherd has not accepted yet.
 *   2. Keep the slots whose normalized load is at most the average,
 *      load_i / w_i <= A / W, and draw two distinct ones uniformly at random
 *      among them (reservoir sampling, bpf_get_prandom_u32).
 *   3. Of the two, take the less loaded (load_a * w_b vs load_b * w_a),
 *      a coin flip on a tie.
 *   4. For a new connection (a SYN) or a migration, reserve the choice:
 *      compare-and-swap the slot's load from the value read in step 2 to
 *      one more (and count it pending). If the load changed meanwhile
 *      (another CPU steered a connection there, or one closed), start again
 *      from 1 with fresh loads, up to STEER_TRIES times.
 * Drawing among the below-average slots rather than among all active slots
 * is what keeps the spread tight: with plain two choices over all slots, 64
 * connections opened one by one over 8 listeners end with a 9 on some
 * listener in ~91% of runs (max/mean 1.125); restricted to below-average
 * slots no listener ever gets above ceil(mean).
 *
 * pending is what makes that hold for bursts too. Without it the load only
 * moved when tetherd accepted: a client pool opening 64 connections at once
 * had every SYN decided on the same stale counts (measured max/mean 1.25 to
 * 1.88, no better than the kernel hash). The kernel runs this program on
 * the SYN, when it creates the request socket (a retransmitted SYN and the
 * final ACK find that request socket and do not come back here), so each
 * decision counts itself before the next SYN is decided; the
 * compare-and-swap makes two CPUs deciding at once see each other. The load
 * is one word (not active + pending read separately) so that an accept,
 * which moves a connection from pending to active, is never seen half done.
 *
 * Only a SYN (SYN set, ACK clear) or a migration counts: the program also
 * runs for stray segments that reach the listener (an ACK or RST of a
 * connection that is gone, the ACK of a syncookie), which select a listener
 * but are not a new connection to accept there (a syncookie ACK is one,
 * uncounted: tetherd's accept then adds it to steer_load). A counted SYN
 * that is never accepted (dropped on a full queue, handshake abandoned) is
 * taken off again by tetherd's listener watcher. See docs/bpf.md.
 *
 * The slots are found by walking slot_table (bpf_loop over TETHER_MAX_SLOTS,
 * twice): array lookups are cheap, the walk runs once per new connection
 * (not per packet), and there is no second, derived "active list" for
 * userspace to keep consistent with slot_table.
 *
 * Two forms are built from this file (bpf/gen.go), and tetherd loads the
 * best one the kernel takes (bpf/probe.go):
 *   - steer (5.17+): the walks and the attempts are bpf_loop callbacks,
 *     attached as BPF_SK_REUSEPORT_SELECT_OR_MIGRATE.
 *   - steerBounded (TETHER_BOUNDED, 5.10+): the same walks as bounded
 *     loops over the TETHER_MAX_SLOTS slots (the most listeners tetherd
 *     opens), the branching in global functions (5.10's verifier knows no
 *     bpf_loop callbacks). A constant set at load, tether_migrate, says
 *     whether the kernel has SK_REUSEPORT_SELECT_OR_MIGRATE and
 *     ctx->migrating_sk (5.14): the verifier reads it from the frozen
 *     .rodata and never visits the branch it turns off. Without it the
 *     program is attached as BPF_SK_REUSEPORT_SELECT: a retired listener's
 *     queue is drained first (userspace/listener) or moves with
 *     net.ipv4.tcp_migrate_req=1. A choice is counted with an atomic add,
 *     not a compare-and-swap (5.12, and 5.10 refuses the instruction even
 *     in dead code): two CPUs deciding in the same microsecond may both
 *     take one slot.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "../headers/tether.h"

char _license[] SEC("license") = "Dual BSD/GPL";

#ifdef TETHER_BOUNDED
/* Set by tetherd at load from its probe of the kernel (bpf/probe.go). */
const volatile __u32 tether_migrate = 0; /* SELECT_OR_MIGRATE, migrating_sk: 5.14 */
#define HAVE_MIGRATE (tether_migrate != 0)
/*
 * No compare-and-swap (5.12): 5.10 refuses an atomic other than add
 * anywhere in the object, even in a branch the verifier never visits.
 */
#define HAVE_CAS 0
/* A walk's step, inlined into its bounded loop. */
#define STEP static __always_inline long
#else
#define HAVE_MIGRATE 1
#define HAVE_CAS 1
/* A walk's step, a bpf_loop callback. */
#define STEP static long
#endif

/* Whether this run migrates a queued connection of a closing listener. */
static __always_inline int migrating(struct sk_reuseport_md *ctx)
{
	if (!HAVE_MIGRATE)
		return 0;
	return ctx->migrating_sk != 0;
}

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

/* Key hash -> owning worker, for the routing policies and learned session ids (headers/tether.h). */
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

/*
 * The load of slot i: active + pending as one word, written concurrently by
 * userspace atomics and other CPUs' reservations: one aligned 64-bit load.
 */
static __always_inline __u64 slot_load_of(__u32 i)
{
	struct tether_slot_load *l = bpf_map_lookup_elem(&slot_load, &i);

	return l ? *(volatile __u64 *)&l->steer_load : 0;
}

static __always_inline const struct tether_slot *active_slot(__u32 i)
{
	const struct tether_slot *s = bpf_map_lookup_elem(&slot_table, &i);

	if (!s || s->state != TETHER_SLOT_ACTIVE)
		return 0;
	return s;
}

/*
 * The two candidate slots: a, and b when found_b. What was found is told
 * by flags, never by comparing a or b with a sentinel (the bounded form's
 * verifier would keep every slot number they can hold as a state of its
 * own).
 */
#define NO_SLOT ((__u32)-1)
struct choice {
	__u64 total_load, total_weight; /* over the active slots */
	__u32 seen;                     /* slots at or below the average so far */
	__u32 found_b;                  /* a second candidate in b */
	__u32 a, b;
	__u64 load_a, load_b; /* active + pending, as read */
	__u64 w_a, w_b;       /* weights */
};

/* What choose found. */
enum { CHOSEN, NO_ACTIVE_SLOT, RACED };

/* The less loaded first: load_b/w_b < load_a/w_a, or a coin flip on a tie. */
static __always_inline void order(struct choice *c)
{
	__u64 la = c->load_a * c->w_b, lb = c->load_b * c->w_a;

	if (lb < la || (lb == la && (bpf_get_prandom_u32() & 1))) {
		__u32 t = c->a;
		__u64 tl = c->load_a, tw = c->w_a;

		c->a = c->b, c->load_a = c->load_b, c->w_a = c->w_b;
		c->b = t, c->load_b = tl, c->w_b = tw;
	}
}

#ifndef TETHER_BOUNDED
/* bpf_loop callback, pass 1: totals over the active slots. */
static long add_slot(__u32 i, void *arg)
{
	struct choice *c = arg;
	const struct tether_slot *s = active_slot(i);

	if (s) {
		c->total_load += slot_load_of(i);
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
	load = slot_load_of(i);
	w = slot_weight(s);
	if (load * c->total_weight > c->total_load * w)
		return 0; /* above average */
	c->seen++;
	if (c->seen == 1) {
		c->a = i, c->load_a = load, c->w_a = w;
	} else if (c->seen == 2) {
		c->b = i, c->load_b = load, c->w_b = w, c->found_b = 1;
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
 * Fills c, the better candidate in c->a. The walks use bpf_loop so that the
 * verifier checks each callback once instead of unrolling TETHER_MAX_SLOTS
 * iterations of branches.
 */
static __always_inline int choose(struct choice *c)
{
	__builtin_memset(c, 0, sizeof(*c));
	c->a = NO_SLOT;
	c->b = NO_SLOT;
	bpf_loop(TETHER_MAX_SLOTS, add_slot, c, 0);
	if (c->total_weight == 0)
		return NO_ACTIVE_SLOT;
	bpf_loop(TETHER_MAX_SLOTS, sample_slot, c, 0);
	/*
	 * At least one active slot is at or below the average, unless
	 * slot_load or slot_table changed between the passes: other CPUs
	 * steering a burst raised loads after pass 1 read them. Try again.
	 */
	if (c->seen == 0)
		return RACED;
	if (c->found_b)
		order(c);
	return CHOSEN;
}
#else /* TETHER_BOUNDED */
/*
 * The bounded form: the same choice (two distinct slots drawn uniformly
 * among the active ones at or below the weighted average, the less loaded
 * first), in three walks of plain loops whose bodies do not branch. A 5.10
 * verifier follows a bounded loop iteration by iteration, and branches in
 * the body multiply its states (reservoir sampling as above: over a million
 * instructions at 16 slots). So what branches is in global functions, which
 * the verifier checks once, on their own, and whose results it takes for
 * any value: the walks only add them up.
 */

/* Slot i's weight if it is active, else 0. */
__attribute__((noinline)) __u64 tether_active_weight(__u32 i)
{
	const struct tether_slot *s = active_slot(i);

	return s ? slot_weight(s) : 0;
}

/* Slot i's load (active + pending). */
__attribute__((noinline)) __u64 tether_load(__u32 i)
{
	return slot_load_of(i);
}

/* Slot i's load if it is active, else 0. */
__attribute__((noinline)) __u64 tether_active_load(__u32 i)
{
	return active_slot(i) ? slot_load_of(i) : 0;
}

/* 1 if slot i is active and at or below the weighted average, else 0. */
__attribute__((noinline)) __u64 tether_below(__u32 i, __u64 total_load, __u64 total_weight)
{
	const struct tether_slot *s = active_slot(i);

	if (!s)
		return 0;
	return slot_load_of(i) * total_weight <= total_load * slot_weight(s);
}

/* 1 if x == y, else 0. */
__attribute__((noinline)) __u64 tether_eq(__u64 x, __u64 y)
{
	return x == y;
}

static __always_inline int choose(struct choice *c)
{
	__u64 below = 0, k = 0, ra, rb, a1 = 0, b1 = 0;

	__builtin_memset(c, 0, sizeof(*c));
	_Pragma("clang loop unroll(disable)")
	for (__u32 i = 0; i < TETHER_MAX_SLOTS; i++) {
		c->total_weight += tether_active_weight(i);
		c->total_load += tether_active_load(i);
	}
	if (c->total_weight == 0)
		return NO_ACTIVE_SLOT;
	_Pragma("clang loop unroll(disable)")
	for (__u32 i = 0; i < TETHER_MAX_SLOTS; i++)
		below += tether_below(i, c->total_load, c->total_weight);
	/* Loads changed between the walks (see above): try again. */
	if (below == 0)
		return RACED;
	/* The ra-th and rb-th (from 0) of them, distinct. */
	ra = bpf_get_prandom_u32() % below;
	rb = below; /* none: only one qualifies */
	if (below > 1) {
		rb = bpf_get_prandom_u32() % (below - 1);
		if (rb >= ra)
			rb++;
	}
	/* a1, b1: the slot numbers + 1, found; 0, not. */
	_Pragma("clang loop unroll(disable)")
	for (__u32 i = 0; i < TETHER_MAX_SLOTS; i++) {
		__u64 q = tether_below(i, c->total_load, c->total_weight);

		a1 += q * tether_eq(k, ra) * (i + 1);
		b1 += q * tether_eq(k, rb) * (i + 1);
		k += q;
	}
	if (a1 == 0 || a1 > TETHER_MAX_SLOTS)
		return RACED; /* loads changed between the walks */
	c->a = a1 - 1;
	c->load_a = tether_load(c->a);
	c->w_a = tether_active_weight(c->a);
	if (b1 == 0 || b1 > TETHER_MAX_SLOTS)
		return CHOSEN; /* a only */
	c->b = b1 - 1;
	c->load_b = tether_load(c->b);
	c->w_b = tether_active_weight(c->b);
	c->found_b = 1;
	order(c);
	return CHOSEN;
}
#endif

/*
 * Whether this run places a connection that tetherd will accept from the
 * selected listener, and so counts it there: a migration, or a SYN.
 * ctx->data starts at the TCP header; byte 13 holds the flags. Anything
 * else that reaches a listener (an ACK or RST of a connection that is gone,
 * a syncookie ACK) is steered but not counted. Should the header not be
 * readable, count: an extra count is taken off again by the watcher.
 */
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_ACK 0x10
static __always_inline int counts(struct sk_reuseport_md *ctx)
{
	__u8 *data = ctx->data, *end = ctx->data_end;

	if (migrating(ctx))
		return 1;
	if (ctx->ip_protocol != 6 /* IPPROTO_TCP */ || data + 14 > end)
		return 1;
	return (data[13] & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
}

/*
 * Counts one more connection on slot i if its load still is `seen`, the
 * value the choice was made on; returns 0, counting nothing, if it changed
 * meanwhile. steered (monotonic, written only here) goes up before and
 * pending after steer_load: tetherd's watcher reads pending, then steered,
 * and must never see a pending connection that steered does not cover;
 * tetherd's accept keeps steer_load = active + pending whichever way it
 * falls between the two updates (see stats.Slot.Opened).
 */
static __always_inline int reserve(__u32 i, __u64 seen)
{
	struct tether_slot_load *l = bpf_map_lookup_elem(&slot_load, &i);

	if (!l)
		return 1;
	if (!HAVE_CAS) {
		__sync_fetch_and_add(&l->steered, 1);
		__sync_fetch_and_add(&l->steer_load, 1);
		__sync_fetch_and_add(&l->pending, 1);
		return 1;
	}
	__sync_fetch_and_add(&l->steered, 1);
	if (__sync_val_compare_and_swap(&l->steer_load, seen, seen + 1) != seen) {
		__sync_fetch_and_add(&l->steered, -1);
		return 0;
	}
	__sync_fetch_and_add(&l->pending, 1);
	return 1;
}

/* Counts one more connection on slot i, whatever its load. */
static __always_inline void add_pending(__u32 i)
{
	struct tether_slot_load *l = bpf_map_lookup_elem(&slot_load, &i);

	if (l) {
		__sync_fetch_and_add(&l->steered, 1);
		__sync_fetch_and_add(&l->steer_load, 1);
		__sync_fetch_and_add(&l->pending, 1);
	}
}

/* Selects slot i for this connection; 0 on success. */
static __always_inline long select_slot(struct sk_reuseport_md *ctx, __u32 i)
{
	return bpf_sk_select_reuseport(ctx, &listener_sockets, &i, 0);
}

/*
 * Attempts at a reserved choice. One fails when another CPU steered a
 * connection to the chosen slot, or tetherd closed one there, between the
 * read and the compare-and-swap, or when loads grew between the two passes
 * of choose: windows of a microsecond or two.
 */
#ifndef STEER_TRIES
#define STEER_TRIES 4
#endif

/* One run of the program, across its attempts. */
struct steer {
	struct sk_reuseport_md *ctx;
	struct choice c;
	__u32 key;      /* the slot the kernel will use, once selected */
	__u32 selected; /* key is set */
	__u32 counted;  /* a SYN or a migration: count it on the slot */
	__u32 reserved; /* counted with a successful compare-and-swap */
	__u32 fallback; /* why nothing was selected: enum tether_decision */
};

/*
 * One attempt; returns 1 when done. A bpf_loop callback (the verifier
 * checks the attempt once), or inlined into a bounded loop.
 */
STEP steer_try(__u32 i, void *arg)
{
	struct steer *st = arg;
	__u32 pick = NO_SLOT;
	__u64 seen = 0; /* the load the pick was made on */
	int picked = 0;

	switch (choose(&st->c)) {
	case NO_ACTIVE_SLOT:
		st->fallback = TETHER_DECISION_FALLBACK_NO_SLOT;
		return 1;
	case RACED:
		return 0;
	}
	if (select_slot(st->ctx, st->c.a) == 0) {
		pick = st->c.a, seen = st->c.load_a, picked = 1;
	} else if (st->c.found_b && select_slot(st->ctx, st->c.b) == 0) {
		/*
		 * The preferred slot has no usable socket (closed a moment ago
		 * and not yet marked in slot_table, or not in this group): the
		 * other one.
		 */
		pick = st->c.b, seen = st->c.load_b, picked = 1;
	}
	if (!picked) {
		st->fallback = TETHER_DECISION_FALLBACK_SELECT_ERR;
		return 1;
	}
	/*
	 * A failed select leaves an earlier attempt's selection in place, a
	 * successful one replaces it: key is what the kernel will use.
	 */
	st->key = pick;
	st->selected = 1;
	if (!st->counted || reserve(pick, seen)) {
		st->reserved = 1;
		return 1;
	}
	return 0;
}

/*
 * Every path returns SK_PASS, with or without a selection. SK_DROP is never
 * returned: for a new connection it would drop the SYN (the client retries a
 * second later), for a migration it would reset a connection the client
 * already completed.
 */
#ifdef TETHER_BOUNDED
/* Attached as SELECT_OR_MIGRATE when tether_migrate is set (bpf/probe.go). */
SEC("sk_reuseport")
#else
SEC("sk_reuseport/migrate")
#endif
int tether_steer(struct sk_reuseport_md *ctx)
{
	int moving = migrating(ctx);
	__u32 base = moving ? TETHER_DECISION_MIGRATED_TO : TETHER_DECISION_SELECTED;
	struct steer st = {
		.ctx = ctx,
		.key = NO_SLOT,
		.counted = counts(ctx),
		/* every attempt raced: no slot chosen, as with none active */
		.fallback = TETHER_DECISION_FALLBACK_NO_SLOT,
	};
	__u32 key;

#ifdef TETHER_BOUNDED
	_Pragma("clang loop unroll(disable)")
	for (__u32 t = 0; t < STEER_TRIES; t++)
		if (steer_try(t, &st))
			break;
#else
	bpf_loop(STEER_TRIES, steer_try, &st, 0);
#endif
	key = st.key;
	if (!st.selected) {
		/*
		 * SK_PASS without a selection, the kernel's hash over the group
		 * decides. No active slot: tetherd is starting, stopping, or
		 * every listener is draining; better any listener than a
		 * refused connection (for a migration the kernel hashes among
		 * the remaining listeners, so it still moves). Both choices
		 * failed to select: a connection is never dropped because of
		 * stale steering state.
		 */
		count(st.fallback);
		return SK_PASS;
	}
	/* Contended STEER_TRIES times: keep the last choice, counted anyway. */
	if (st.counted && !st.reserved)
		add_pending(key);

	/* key < TETHER_MAX_SLOTS, a power of two; masked, not compared (choice) */
	count(base + (key & (TETHER_MAX_SLOTS - 1)));
	if (moving)
		count(TETHER_DECISION_MIGRATED);
	/* SK_PASS with a selection: the kernel uses the selected socket. */
	return SK_PASS;
}
