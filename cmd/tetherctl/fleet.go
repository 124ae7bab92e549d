package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/tether-rl/tether/userspace/fleet"
)

// readFleet asks the admin API for the weight sync's state (GET /fleet).
func readFleet(ac *adminClient) (*fleet.Report, error) {
	body, err := ac.do("GET", "/fleet", nil)
	if err != nil {
		return nil, err
	}
	var r fleet.Report
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("GET /fleet: %w", err)
	}
	return &r, nil
}

// printFleet prints the weight sync: the phase, what is held, the target
// version, and each worker's version and state in the sync.
func (st *Status) printFleet(w io.Writer) error {
	r := st.Fleet
	if r == nil {
		return nil
	}
	phase := r.Phase
	if r.Mode != "" {
		phase += " (" + r.Mode + ")"
	}
	target := r.TargetVersion
	if target == "" {
		target = "none set"
	}
	fmt.Fprintf(w, "\nFLEET: %s for %.1fs, epoch %d, target version %s; %d requests held now (%d released, %d timed out, %d refused: hold full); %d pauses\n",
		phase, r.PhaseSinceS, r.Epoch, target, r.Held, r.Released, r.HoldTimeouts, r.HoldFull, r.Cycles)
	if r.ClusterLink == "down" {
		fmt.Fprintln(w, "cluster store out of sight: this replica holds generation requests until it sees it again")
	}
	if len(r.Workers) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SLOT\tENGINE\tSYNC\tWEIGHT_VERSION\tIN_FLIGHT\tURL")
	for _, x := range r.Workers {
		v := x.WeightVersion
		if v == "" {
			v = "-"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\n", x.Slot, x.Engine, x.State, v, x.InFlight, x.URL)
	}
	return tw.Flush()
}
