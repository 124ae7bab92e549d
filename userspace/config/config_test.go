package config

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

func flags() (*flag.FlagSet, *list, *string, *time.Duration, *bool, *int) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var workers list
	fs.Var(&workers, "worker", "")
	bad := fs.String("bad-session", "spread", "")
	iv := fs.Duration("health-interval", 5*time.Second, "")
	on := fs.Bool("admin-on-data-port", false, "")
	n := fs.Int("health-failures", 3, "")
	fs.String("config", "", "")
	return fs, &workers, bad, iv, on, n
}

func TestApply(t *testing.T) {
	fs, workers, bad, iv, on, n := flags()
	err := Apply(fs, []byte(`{"worker":["http://a:1","http://b:2"],"bad-session":"reject",
		"health-interval":"250ms","admin-on-data-port":true,"health-failures":5}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(*workers) != 2 || (*workers)[1] != "http://b:2" || *bad != "reject" || *iv != 250*time.Millisecond || !*on || *n != 5 {
		t.Fatalf("%v %v %v %v %v", *workers, *bad, *iv, *on, *n)
	}
}

func TestCommandLineWins(t *testing.T) {
	fs, workers, bad, _, _, _ := flags()
	fs.Parse([]string{"--bad-session", "spread", "--worker", "http://c:3"})
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	if err := Apply(fs, []byte(`{"worker":["http://a:1"],"bad-session":"reject"}`), explicit); err != nil {
		t.Fatal(err)
	}
	if *bad != "spread" || len(*workers) != 1 || (*workers)[0] != "http://c:3" {
		t.Fatalf("%v %v", *bad, *workers)
	}
}

func TestErrorsNameTheField(t *testing.T) {
	for in, want := range map[string]string{
		`{"wroker":["x"]}`:                 `field "wroker": unknown`,
		`{"config":"x.json"}`:              `field "config": unknown`,
		`{"health-interval":"soon"}`:       `field "health-interval": invalid value "soon"`,
		`{"health-failures":1.5}`:          `field "health-failures": invalid value "1.5"`,
		`{"admin-on-data-port":"perhaps"}`: `field "admin-on-data-port": invalid value`,
		`{"bad-session":{"a":1}}`:          `field "bad-session": want a string, number or boolean, not an object`,
		`{"worker":[["x"]]}`:               `field "worker": list element`,
		`{"bad-session":null}`:             `field "bad-session": null`,
		`[1,2]`:                            `not a JSON object`,
		`{"worker":`:                       `not a JSON object`,
		`{} {}`:                            `data after the object`,
		`null`:                             `not a JSON object`,
	} {
		fs, _, _, _, _, _ := flags()
		err := Apply(fs, []byte(in), nil, "config")
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", in, err, want)
		}
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "tetherd.json")
	os.WriteFile(p, []byte(`{"bad-session":"reject"}`), 0o600)
	fs, _, bad, _, _, _ := flags()
	if err := Load(fs, p, nil); err != nil || *bad != "reject" {
		t.Fatal(err, *bad)
	}
	if err := Load(fs, filepath.Join(dir, "missing.json"), nil); err == nil {
		t.Fatal("missing file accepted")
	}
	os.WriteFile(p, []byte(`{"health-interval":"x"}`), 0o600)
	if err := Load(fs, p, nil); err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "health-interval") {
		t.Fatalf("error %v names neither file nor field", err)
	}
}
