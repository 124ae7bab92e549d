// Command tetherctl inspects and steers a running tetherd through the BPF
// maps it pins in bpffs (bpf.DefaultPinDir).
//
//	tetherctl status [--json] [--pin-dir DIR]
//	tetherctl listeners drain N [--pin-dir DIR]
//	tetherctl upgrade [--pidfile FILE]
//
// main only dispatches: each verb is a function in its own file, taking its
// arguments and output streams, so that tests call it directly.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
)

// A verb runs one tetherctl command. It returns a *usageError for bad
// arguments (exit 2) and any other error for a failure (exit 1).
type verb struct {
	name  string
	usage string
	run   func(args []string, stdout io.Writer) error
}

// verbs lists tetherctl's commands; add one by appending here.
var verbs = []verb{
	{"status", "status [--json] [--pin-dir DIR] [--admin URL]  listeners and workers (pinned maps), routing decisions (admin API)", cmdStatus},
	{"listeners", "listeners drain N [--pin-dir DIR]   retire listener slot N without resetting a client", cmdListeners},
	{"workers", workersUsage, cmdWorkers},
	{"upgrade", upgradeUsage, cmdUpgrade},
}

type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// run dispatches args to a verb and returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		printUsage(stderr)
		return 2
	}
	for _, v := range verbs {
		if v.name != args[0] {
			continue
		}
		err := v.run(args[1:], stdout)
		var ue *usageError
		switch {
		case err == nil:
			return 0
		case errors.As(err, &ue):
			fmt.Fprintf(stderr, "tetherctl %s: %v\nusage: tetherctl %s\n", v.name, err, v.usage)
			return 2
		default:
			fmt.Fprintf(stderr, "tetherctl %s: %v\n", v.name, err)
			return 1
		}
	}
	fmt.Fprintf(stderr, "tetherctl: unknown command %q\n", args[0])
	printUsage(stderr)
	return 2
}

func printUsage(w io.Writer) {
	fmt.Fprintln(w, "usage:")
	for _, v := range verbs {
		fmt.Fprintf(w, "  tetherctl %s\n", v.usage)
	}
}
