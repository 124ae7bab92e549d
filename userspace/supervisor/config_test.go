package supervisor

import (
	"strings"
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		c    Config
		want string // "": accepted; else the start of the error
	}{
		{Config{}, ""},
		{DefaultConfig(), ""},
		{Config{N: 2, Command: []string{"tether-demo"}, Grace: time.Second}, ""},
		{Config{N: -1}, "--spawn: negative; want a value >= 0"},
		{Config{Grace: -time.Second}, "--spawn-grace: negative"},
		{Config{N: 1}, "--spawn: give the worker command after --"},
		{Config{N: 1, Command: []string{" "}}, "--spawn: give the worker command after --"},
	} {
		err := tc.c.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.want)) {
			t.Errorf("%+v: %v, want %q", tc.c, err, tc.want)
		}
	}
}

func TestConfigProvision(t *testing.T) {
	if d := DefaultConfig(); d.N != 0 || d.Command != nil || d.Grace != DefaultGrace {
		t.Fatalf("DefaultConfig: %+v", d)
	}
	c := Config{N: 2, Grace: time.Second}
	c.Provision()
	if c.N != 2 || c.Grace != time.Second {
		t.Fatalf("provisioned over settings: %+v", c)
	}
}
