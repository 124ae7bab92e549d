package main

import (
	"flag"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestReadmeFlagTable: every flag is in the README's flag table, and the
// defaults the table states are the flags' (where the table gives one a
// machine can compare: a duration, a number, a size, on/off, a word).
func TestReadmeFlagTable(t *testing.T) {
	c, err := parse([]string{"--listen", "127.0.0.1:0", "--demo", "1"})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	names := regexp.MustCompile("--([a-z0-9-]+)")
	listed := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "| `--") {
			continue
		}
		cols := strings.Split(line, " | ")
		var flags []string
		for _, m := range names.FindAllStringSubmatch(cols[0], -1) {
			flags = append(flags, m[1])
			listed[m[1]] = true
		}
		if len(cols) < 3 {
			continue // no default
		}
		defs := strings.Split(cols[1], " / ")
		if len(defs) != len(flags) {
			defs = strings.Fields(cols[1]) // "5s 2s 3 2"
		}
		if len(defs) != len(flags) {
			continue
		}
		for i, name := range flags {
			f := c.fs.Lookup(name)
			if f == nil {
				t.Errorf("README lists --%s, which tetherd does not have", name)
				continue
			}
			// (A flag without a default of its own, "", has it written
			// in its help: --cluster-name, --bpf-pin-dir.)
			if want, ok := readmeDefault(defs[i]); ok && f.DefValue != "" && !sameDefault(f, want) {
				t.Errorf("README: --%s defaults to %q, the flag to %q", name, defs[i], f.DefValue)
			}
		}
	}
	c.fs.VisitAll(func(f *flag.Flag) {
		if !listed[f.Name] {
			t.Errorf("--%s is missing from the README's flag table", f.Name)
		}
	})
}

// readmeDefault returns a default of the README's table in a form
// sameDefault compares; ok=false: one to read, not to compare.
func readmeDefault(s string) (string, bool) {
	s = strings.Trim(strings.TrimSpace(s), "`")
	for _, sep := range []string{" (", ": "} {
		if i := strings.Index(s, sep); i > 0 {
			s = s[:i] // "0 (none)", "0: derived"
		}
	}
	switch s {
	case "on":
		return "true", true
	case "off":
		return "false", true
	case "", "none", "random":
		return "", false
	}
	for unit, n := range map[string]int64{" KiB": 1 << 10, " MiB": 1 << 20, " GiB": 1 << 30} {
		if v, ok := strings.CutSuffix(s, unit); ok {
			if k, err := strconv.ParseInt(v, 10, 64); err == nil {
				return strconv.FormatInt(k*n, 10), true
			}
		}
	}
	if strings.ContainsAny(s, " ()") {
		return "", false
	}
	return s, true
}

func sameDefault(f *flag.Flag, want string) bool {
	if f.DefValue == want {
		return true
	}
	a, errA := time.ParseDuration(f.DefValue)
	b, errB := time.ParseDuration(want)
	if errA == nil && errB == nil {
		return a == b
	}
	x, errX := strconv.ParseFloat(f.DefValue, 64)
	y, errY := strconv.ParseFloat(want, 64)
	return errX == nil && errY == nil && x == y
}
