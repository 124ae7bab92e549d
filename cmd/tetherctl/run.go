package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/tether-rl/tether/userspace/admin"
)

// This run's counters: the pinned maps outlive tetherd (by design: an
// upgrade continues them), so their totals include earlier runs; tetherd
// keeps the counters as they were at its start (GET /baseline), and the
// difference is this run's.

// RunStatus is what this tetherd counted since it started.
type RunStatus struct {
	Instance  string        `json:"instance_id"`
	Started   time.Time     `json:"started"`
	Workers   []RunWorker   `json:"workers"`
	Listeners []RunListener `json:"listeners"`
}

// RunWorker is one current worker's counts since the start.
type RunWorker struct {
	Slot      int    `json:"slot"`
	URL       string `json:"url"`
	Requests  uint64 `json:"requests"`
	Errors    uint64 `json:"errors"`
	BytesUp   uint64 `json:"bytes_up"`
	BytesDown uint64 `json:"bytes_down"`
	Retries   uint64 `json:"retries"`
}

// RunListener is one listener's connections since the start.
type RunListener struct {
	Slot     int    `json:"slot"`
	Accepted uint64 `json:"accepted"`
	Closed   uint64 `json:"closed"`
}

// readRun asks the admin API for the counters at the start and takes them
// from the pinned ones, for the slots that hold a worker now.
func (st *Status) readRun(ac *adminClient) error {
	body, err := ac.do("GET", "/baseline", nil)
	if err != nil {
		return err
	}
	var b admin.Baseline
	if err := json.Unmarshal(body, &b); err != nil {
		return fmt.Errorf("GET /baseline: %w", err)
	}
	base := map[int]admin.WorkerBaseline{}
	for _, w := range b.Workers {
		base[w.Slot] = w
	}
	run := &RunStatus{Instance: b.Instance, Started: b.Started, Workers: []RunWorker{}, Listeners: []RunListener{}}
	for _, w := range st.Workers {
		if w.Current == nil || !*w.Current {
			continue // no worker now: nothing of it is this run's
		}
		x := base[w.Slot]
		run.Workers = append(run.Workers, RunWorker{Slot: w.Slot, URL: w.URL, Requests: admin.Since(w.Requests, x.Requests),
			Errors: admin.Since(w.Errors, x.Errors), BytesUp: admin.Since(w.BytesUp, x.BytesUp),
			BytesDown: admin.Since(w.BytesDown, x.BytesDown), Retries: admin.Since(w.Retries, x.Retries)})
	}
	lb := map[int]admin.ListenerCounts{}
	for _, l := range b.Listeners {
		lb[l.Slot] = l
	}
	for _, l := range st.Listeners {
		x, ok := lb[l.Slot]
		if !ok {
			continue // not one of this tetherd's listeners
		}
		run.Listeners = append(run.Listeners, RunListener{Slot: l.Slot, Accepted: admin.Since(l.Accepted, x.Accepted), Closed: admin.Since(l.Closed, x.Closed)})
	}
	st.Run = run
	return nil
}

// printRun prints this run's counters, apart from the pinned totals.
func (st *Status) printRun(w io.Writer) error {
	r := st.Run
	if r == nil {
		return nil
	}
	fmt.Fprintf(w, "\nTHIS RUN (since this tetherd started at %s, %s ago; instance %s)\n", r.Started.Local().Format(time.DateTime),
		time.Since(r.Started).Round(time.Second), r.Instance)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SLOT\tREQUESTS\tERRORS\tBYTES_UP\tBYTES_DOWN\tRETRIES\tWORKER")
	for _, x := range r.Workers {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%d\t%s\n", x.Slot, x.Requests, x.Errors, x.BytesUp, x.BytesDown, x.Retries, x.URL)
	}
	if len(r.Workers) == 0 {
		fmt.Fprintln(tw, "(no worker now)")
	}
	for _, l := range r.Listeners {
		fmt.Fprintf(tw, "listener %d\t%d accepted\t%d closed\t\t\t\t\n", l.Slot, l.Accepted, l.Closed)
	}
	return tw.Flush()
}
