package main

import (
	"fmt"
	"io"
	"strconv"

	"github.com/tether-rl/tether/bpf"
)

func cmdListeners(args []string, stdout io.Writer) error {
	fs, pinDir := newFlags("listeners drain")
	i := firstArg(args, valueIn(fs))
	if i < 0 || args[i] != "drain" {
		return usagef("want: listeners drain N")
	}
	pos, err := parse(fs, without(args, i))
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("want one slot number")
	}
	slot, err := strconv.Atoi(pos[0])
	if err != nil || slot < 0 || slot >= bpf.MaxSlots {
		return usagef("slot %q: want a number in [0, %d)", pos[0], bpf.MaxSlots)
	}
	return drainListener(stdout, *pinDir, slot)
}

// drainListener marks slot draining in the pinned slot_table: the program
// stops sending it new connections at once, and tetherd's watcher closes
// the listener once its accept queue is empty (what is queued migrates).
func drainListener(w io.Writer, pinDir string, slot int) error {
	s, err := openPins(pinDir, false)
	if err != nil {
		return err
	}
	defer s.Close()
	state, weight, err := s.Slot(slot)
	if err != nil {
		return err
	}
	switch state {
	case bpf.SlotEmpty:
		return fmt.Errorf("slot %d has no listener", slot)
	case bpf.SlotDraining:
		fmt.Fprintf(w, "slot %d is already draining\n", slot)
		return nil
	}
	slots, err := s.Slots()
	if err != nil {
		return err
	}
	active := 0
	for _, si := range slots {
		if si.State == bpf.SlotActive {
			active++
		}
	}
	if active <= 1 {
		// Nothing would be left to accept, or to take what is queued.
		return fmt.Errorf("slot %d is the last active listener: it stays (tetherd would stop accepting)", slot)
	}
	if err := s.SetSlotState(slot, bpf.SlotDraining, weight); err != nil {
		return err
	}
	fmt.Fprintf(w, "slot %d marked draining: no new connections; tetherd closes it once its accept queue is empty\n", slot)
	return nil
}
