package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/stats"
)

// Status is what `tetherctl status` reports (also its --json form).
type Status struct {
	PinDir string `json:"pin_dir"`
	// Running: some listener slot holds a socket (the kernel drops a
	// closed socket from listener_sockets, so a killed tetherd shows too).
	Running   bool             `json:"running"`
	Listeners []ListenerStatus `json:"listeners"`
	Decisions bpf.Decisions    `json:"decisions"`
	Workers   []WorkerStatus   `json:"workers"`
}

// ListenerStatus is one listener slot that is in use or has counted anything.
type ListenerStatus struct {
	Slot     int    `json:"slot"`
	State    string `json:"state"`
	Weight   uint32 `json:"weight"`
	Active   uint64 `json:"active"`
	Accepted uint64 `json:"accepted"`
	Closed   uint64 `json:"closed"`
	Selected uint64 `json:"selected"`
	Migrated uint64 `json:"migrated"`
}

// WorkerStatus is one worker slot with a nonzero counter.
type WorkerStatus struct {
	Slot      int    `json:"slot"`
	InFlight  uint64 `json:"in_flight"`
	Requests  uint64 `json:"requests"`
	Errors    uint64 `json:"errors"`
	BytesUp   uint64 `json:"bytes_up"`
	BytesDown uint64 `json:"bytes_down"`
	Retries   uint64 `json:"retries"`
	Conns     uint64 `json:"conns"`
}

func cmdStatus(args []string, stdout io.Writer) error {
	fs, pinDir := newFlags("status")
	asJSON := fs.Bool("json", false, "print JSON")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usagef("unexpected argument %q", pos[0])
	}
	return status(stdout, *pinDir, *asJSON)
}

// status prints tetherd's listeners and workers from the maps pinned in
// pinDir, opened read-only.
func status(w io.Writer, pinDir string, asJSON bool) error {
	st, err := readStatus(pinDir)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		err = enc.Encode(st)
	} else {
		err = st.print(w)
	}
	if err == nil && !st.Running {
		err = fmt.Errorf("tetherd is not running: no listener socket in %s/listener_sockets (the counters shown are from its last run)", pinDir)
	}
	return err
}

func readStatus(pinDir string) (*Status, error) {
	s, err := openPins(pinDir, true)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	slots, err := s.Slots()
	if err != nil {
		return nil, err
	}
	d, err := s.Decisions()
	if err != nil {
		return nil, err
	}
	serving, err := s.Serving()
	if err != nil {
		return nil, err
	}
	st := &Status{PinDir: pinDir, Running: len(serving) > 0, Decisions: d, Listeners: []ListenerStatus{}, Workers: []WorkerStatus{}}
	for _, sl := range slots {
		if sl.State == bpf.SlotEmpty && sl.Load.Accepted == 0 && sl.Load.Active == 0 && sl.Selected == 0 && sl.Migrated == 0 {
			continue
		}
		st.Listeners = append(st.Listeners, ListenerStatus{
			Slot: sl.Slot, State: sl.State.String(), Weight: max(sl.Weight, 1),
			Active: sl.Load.Active, Accepted: sl.Load.Accepted, Closed: sl.Load.Closed,
			Selected: sl.Selected, Migrated: sl.Migrated,
		})
	}
	for i := range bpf.MaxWorkers {
		c := s.Stats().Worker(i).Load()
		if c == (stats.WorkerSnapshot{}) {
			continue
		}
		st.Workers = append(st.Workers, WorkerStatus{
			Slot: i, InFlight: c.InFlight, Requests: c.Requests, Errors: c.Errors,
			BytesUp: c.BytesUp, BytesDown: c.BytesDown, Retries: c.Retries, Conns: c.Conns,
		})
	}
	return st, nil
}

func (st *Status) print(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "pins: %s\n\nLISTENERS\n", st.PinDir)
	fmt.Fprintln(tw, "SLOT\tSTATE\tWEIGHT\tACTIVE\tACCEPTED\tCLOSED\tSELECTED\tMIGRATED")
	for _, l := range st.Listeners {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\n", l.Slot, l.State, l.Weight, l.Active, l.Accepted, l.Closed, l.Selected, l.Migrated)
	}
	if len(st.Listeners) == 0 {
		fmt.Fprintln(tw, "(none)")
	}
	d := st.Decisions
	fmt.Fprintf(tw, "steering: %d migrated, %d to kernel hash (no active slot), %d to kernel hash (select failed)\n\nWORKERS\n",
		d.Migrated, d.FallbackNoSlot, d.FallbackSelectErr)
	fmt.Fprintln(tw, "SLOT\tIN_FLIGHT\tREQUESTS\tERRORS\tBYTES_UP\tBYTES_DOWN\tRETRIES\tCONNS")
	for _, x := range st.Workers {
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", x.Slot, x.InFlight, x.Requests, x.Errors, x.BytesUp, x.BytesDown, x.Retries, x.Conns)
	}
	if len(st.Workers) == 0 {
		fmt.Fprintln(tw, "(none with a nonzero counter)")
	}
	return tw.Flush()
}
