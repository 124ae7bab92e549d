package config

import (
	"bytes"
	"flag"
	"strings"
	"testing"
	"time"
)

// TestPrintDefaultsIsTheStandardLibrary's: for flags of the flag
// package's own types, PrintDefaults prints what flag.PrintDefaults does.
func TestPrintDefaultsIsTheStandardLibrarys(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.String("s", "x", "a string")
	fs.String("e", "", "an empty `name`")
	fs.Int("n", 0, "an int")
	fs.Int("m", 3, "an int\nover two lines")
	fs.Duration("d", time.Second, "a duration")
	fs.Bool("b", true, "a bool")
	fs.Bool("x", false, "a short bool")
	fs.Uint64("u", 7, "a uint")
	fs.Float64("f", 0.5, "a float")
	var want, got bytes.Buffer
	fs.SetOutput(&want)
	fs.PrintDefaults()
	fs.SetOutput(&got)
	PrintDefaults(fs)
	if got.String() != want.String() {
		t.Fatalf("got\n%s\nwant\n%s", got.String(), want.String())
	}
}

type policyKind int

func (k policyKind) String() string { return [...]string{"hash", "sticky"}[k] }

func parseKind(s string) (policyKind, error) {
	switch s {
	case "hash":
		return 0, nil
	case "sticky":
		return 1, nil
	}
	return 0, flagError("--policy " + s)
}

type flagError string

func (e flagError) Error() string { return string(e) }

type settings struct {
	Timeout time.Duration
	Queue   int
	Veto    Optional[int]
	Poll    Optional[time.Duration]
	Ring    Optional[bool]
	Header  string
	Policy  policyKind
	Path    string
	Keys    []string
}

func (s *settings) list() []Setting {
	return []Setting{
		Num(&s.Timeout, "timeout", 30*time.Second, Positive, "a timeout (> 0)"),
		Num(&s.Queue, "queue", 1024, PositiveOrNone, "queue (-1: none)"),
		Opt(&s.Veto, "veto", 64, NonNegative, "veto; 0: none"),
		Opt(&s.Poll, "poll", time.Second, Any, "poll; 0: off").Type("duration"),
		Switch(&s.Ring, "ring", true, "ring"),
		Flag(&s.Header, "header", "X-Route", "add the header"),
		Mode(&s.Policy, "policy", policyKind(0), "hash or sticky", parseKind),
		Str(&s.Path, "path", "/health", "a path", func(p string) (string, error) {
			if !strings.HasPrefix(p, "/") {
				return "", flagError("--path " + p + ": want an absolute path")
			}
			return p, nil
		}),
		List(&s.Keys, "key", []string{"A", "B"}, true, "keys (default A,B)"),
	}
}

func TestSettings(t *testing.T) {
	var s settings
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var out bytes.Buffer
	fs.SetOutput(&out)
	Register(fs, s.list())
	if s.Timeout != 30*time.Second || s.Queue != 1024 || s.Veto != Some(64) || s.Ring != Some(true) || s.Header != "" || s.Path != "/health" || strings.Join(s.Keys, ",") != "A,B" {
		t.Fatalf("defaults: %+v", s)
	}
	PrintDefaults(fs)
	for _, line := range []string{
		"  -timeout value\n    \ta timeout (> 0) (default 30s)\n",
		"  -veto value\n    \tveto; 0: none (default 64)\n",
		"  -poll duration\n    \tpoll; 0: off (default 1s)\n",
		"  -ring\n    \tring (default true)\n",
		"  -header\n    \tadd the header\n",
		"  -policy string\n    \thash or sticky (default \"hash\")\n",
		"  -key value\n    \tkeys (default A,B)\n",
	} {
		if !strings.Contains(out.String(), line) {
			t.Errorf("help lacks %q:\n%s", line, out.String())
		}
	}
	if err := fs.Parse([]string{"--veto=0", "--poll=0", "--ring=false", "--header", "--policy=sticky", "--queue=-1", "--key", "x, y", "--key=z"}); err != nil {
		t.Fatal(err)
	}
	if s.Veto != Some(0) || s.Poll != Some(time.Duration(0)) || s.Ring.Or(true) || s.Header != "X-Route" || s.Policy != 1 || s.Queue != -1 || strings.Join(s.Keys, ",") != "x,y,z" {
		t.Fatalf("set: %+v", s)
	}
	for _, bad := range [][]string{{"--timeout=0"}, {"--timeout=-1s"}, {"--queue=0"}, {"--queue=-2"}, {"--veto=-1"}, {"--policy=x"}, {"--path=health"}, {"--path="}, {"--ring=maybe"}} {
		if err := fs.Parse(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	// Validate: unset and zero are the defaults; out of range names the flag.
	for _, tc := range []struct {
		s    settings
		want string
	}{
		{settings{}, ""},
		{settings{Queue: -1, Veto: Some(0)}, ""},
		{settings{Timeout: -time.Second}, "--timeout: negative; want a duration > 0"},
		{settings{Queue: -2}, "--queue: negative; want a value > 0, or -1"},
		{settings{Veto: Some(-1)}, "--veto: negative; want a value >= 0"},
		{settings{Path: "x"}, "--path x: want an absolute path"},
	} {
		err := Validate(tc.s.list())
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || err.Error() != tc.want) {
			t.Errorf("%+v: %v, want %q", tc.s, err, tc.want)
		}
	}
}

func TestOptional(t *testing.T) {
	var o Optional[int]
	if o.IsSet() || o.Or(5) != 5 || o.String() != "unset" {
		t.Fatalf("zero: %v", o)
	}
	if o = Some(0); !o.IsSet() || o.Or(5) != 0 || o.String() != "0" {
		t.Fatalf("Some(0): %v", o)
	}
}
