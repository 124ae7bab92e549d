package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/tether-rl/tether/bpf"
)

// newFlags returns a flag set for a verb, with --pin-dir.
func newFlags(name string) (*flag.FlagSet, *string) {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	pinDir := fs.String("pin-dir", bpf.DefaultPinDir, "bpffs directory where tetherd pins its maps")
	return fs, pinDir
}

// parse parses flags that may come before or after the positional
// arguments, and returns the positional ones.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, usagef("%v", err)
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// openPins opens tetherd's pinned maps, with a clear message when there
// are none.
func openPins(pinDir string, readOnly bool) (*bpf.Steering, error) {
	s, err := bpf.OpenPinned(pinDir, readOnly)
	if errors.Is(err, bpf.ErrNotPinned) {
		return nil, fmt.Errorf("tetherd is not running with BPF (no maps pinned at %s)", pinDir)
	}
	return s, err
}
