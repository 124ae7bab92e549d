package main

import (
	"fmt"
	"io"
	"text/tabwriter"
)

// KVEventsStatus is one KV-event subscription of a worker (one per DP
// rank) as GET /workers "kv_events" shows it (daemon.KVEngineStatus).
type KVEventsStatus struct {
	Rank           int    `json:"rank"`
	Endpoint       string `json:"endpoint"`
	Replay         string `json:"replay,omitempty"`
	Connected      bool   `json:"connected"`
	Events         uint64 `json:"events"`
	Malformed      uint64 `json:"malformed"`
	Gaps           uint64 `json:"gaps"`
	Replays        uint64 `json:"replays"`
	ReplayFailures uint64 `json:"replay_failures"`
	Restarts       uint64 `json:"restarts"`
	Lost           uint64 `json:"lost"`
	Blocks         int64  `json:"blocks_indexed"`
}

// printKVEvents shows each worker's KV-event subscriptions: what tetherd
// knows of the engines' caches (nothing when KV-event placement is off).
func (st *Status) printKVEvents(w io.Writer) error {
	has := false
	for _, x := range st.Workers {
		has = has || len(x.KVEvents) > 0
	}
	if !has {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\nKV EVENTS (the engines' caches, per DP rank)\nSLOT\tRANK\tENDPOINT\tCONNECTED\tEVENTS\tGAPS\tREPLAYS\tREPLAY_FAILED\tRESTARTS\tLOST\tMALFORMED\tBLOCKS")
	for _, x := range st.Workers {
		for _, k := range x.KVEvents {
			fmt.Fprintf(tw, "%d\t%d\t%s\t%t\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", x.Slot, k.Rank, k.Endpoint, k.Connected,
				k.Events, k.Gaps, k.Replays, k.ReplayFailures, k.Restarts, k.Lost, k.Malformed, k.Blocks)
		}
	}
	return tw.Flush()
}
