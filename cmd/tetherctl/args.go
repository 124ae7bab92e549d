package main

import (
	"flag"
	"net/url"
	"strings"
)

// Flags go anywhere: before or after the verb, before or after a verb's
// subcommand (tetherctl --admin X workers list, workers --admin X list,
// workers list --admin X). firstArg finds the word (the verb, or the
// subcommand) among the flags; the rest is parsed by the verb's own flag
// set, which takes flags between positional arguments (parse).

// firstArg returns the index of the first argument that is neither a flag
// nor a flag's value, or -1. takesValue says whether a flag (by name, no
// dashes) takes the next argument as its value (not a boolean flag, not
// written --name=value).
func firstArg(args []string, takesValue func(name string) bool) int {
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			if i+1 < len(args) {
				return i + 1
			}
			return -1
		}
		if len(a) < 2 || a[0] != '-' {
			return i
		}
		name := strings.TrimLeft(a, "-")
		if strings.Contains(name, "=") {
			continue
		}
		if takesValue(name) {
			i++ // its value
		}
	}
	return -1
}

// without returns args less the one at i.
func without(args []string, i int) []string {
	return append(append([]string(nil), args[:i]...), args[i+1:]...)
}

// valueIn reports whether the flag name takes a value in one of sets (an
// unknown flag is taken for one without: the verb's parser refuses it).
func valueIn(sets ...*flag.FlagSet) func(string) bool {
	return func(name string) bool {
		for _, fs := range sets {
			if f := fs.Lookup(name); f != nil {
				b, ok := f.Value.(interface{ IsBoolFlag() bool })
				return !ok || !b.IsBoolFlag()
			}
		}
		return false
	}
}

// adminURL reads an admin API address in the form tetherd's --admin takes
// (HOST:PORT, :PORT, or a bare PORT: on this host) or as a URL
// (http://HOST:PORT, https://...), and returns the API's base URL.
func adminURL(s string) (string, error) {
	s = strings.TrimSpace(s)
	in := s
	if s != "" && strings.Trim(s, "0123456789") == "" {
		s = "127.0.0.1:" + s
	}
	if !strings.Contains(s, "://") {
		s = "http://" + s
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return "", usagef("--admin %q: want HOST:PORT (as tetherd's --admin) or http://HOST:PORT", in)
	}
	if u.Hostname() == "" { // ":8081": tetherd listens on every address, this host is one
		u.Host = "127.0.0.1" + u.Host
	}
	return strings.TrimSuffix(u.String(), "/"), nil
}

// etcdEndpoints reads --cluster as tetherd takes it (etcd://HOST:PORT[,...])
// and also in the forms etcd's own tools take (HOST:PORT, http://HOST:PORT,
// comma-separated), returning tetherd's form.
func etcdEndpoints(s string) (string, error) {
	var hps []string
	rest, _ := strings.CutPrefix(strings.TrimSpace(s), "etcd://")
	for _, hp := range strings.Split(rest, ",") {
		hp = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(hp), "http://"), "/")
		if hp == "" || strings.Contains(hp, "://") {
			return "", usagef("--cluster %q: want etcd://HOST:PORT[,HOST:PORT...] (as tetherd's --cluster), HOST:PORT or http://HOST:PORT", s)
		}
		hps = append(hps, hp)
	}
	return "etcd://" + strings.Join(hps, ","), nil
}
