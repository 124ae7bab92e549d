// Command tetherctl inspects and steers a running tetherd through the BPF
// maps it pins in bpffs (bpf.DefaultPinDir).
//
//	tetherctl status [--json] [--pin-dir DIR] [--admin HOST:PORT]
//	tetherctl listeners drain N [--pin-dir DIR]
//	tetherctl workers list|add|remove|drain|undrain|register ...
//	tetherctl fleet [watch [--interval 2s] [--count N]]
//	tetherctl upgrade [--pidfile FILE]
//
// Flags go before or after the verb and its subcommand; an address is
// HOST:PORT (as tetherd's own flags take it) or a URL.
//
// main only dispatches: each verb is a function in its own file, taking its
// arguments and output streams, so that tests call it directly.
package main

import (
	"errors"
	"flag"
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
	// flags returns the verb's flags (every subcommand's): which take a
	// value, to find the verb after flags written before it.
	flags func() *flag.FlagSet
}

// verbs lists tetherctl's commands; add one by appending here.
var verbs = []verb{
	{"status", "status [--json] [--pin-dir DIR] [--admin HOST:PORT|off]  listeners and workers (pinned maps; which slots hold a worker now and routing decisions: admin API)", cmdStatus, func() *flag.FlagSet { fs, _ := statusFlags(); return fs }},
	{"listeners", "listeners drain N [--pin-dir DIR]   retire listener slot N without resetting a client", cmdListeners, func() *flag.FlagSet { fs, _ := newFlags("listeners"); return fs }},
	{"workers", workersUsage, cmdWorkers, workersFlags},
	{"fleet", fleetUsage, cmdFleet, func() *flag.FlagSet { fs, _, _, _ := fleetFlags(); return fs }},
	{"upgrade", upgradeUsage, cmdUpgrade, func() *flag.FlagSet { fs, _ := upgradeFlags(); return fs }},
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
	// The verb: the first word that is not a flag or a flag's value.
	var sets []*flag.FlagSet
	for _, v := range verbs {
		sets = append(sets, v.flags())
	}
	i := firstArg(args, valueIn(sets...))
	if i < 0 {
		fmt.Fprintf(stderr, "tetherctl: no command in %q\n", args)
		printUsage(stderr)
		return 2
	}
	name, rest := args[i], without(args, i)
	for _, v := range verbs {
		if v.name != name {
			continue
		}
		err := v.run(rest, stdout)
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
	fmt.Fprintf(stderr, "tetherctl: unknown command %q\n", name)
	printUsage(stderr)
	return 2
}

func printUsage(w io.Writer) {
	fmt.Fprintln(w, "usage:")
	for _, v := range verbs {
		fmt.Fprintf(w, "  tetherctl %s\n", v.usage)
	}
	fmt.Fprintln(w, "flags go before or after the command and its subcommand; addresses are HOST:PORT (as tetherd's flags) or http://HOST:PORT")
}
