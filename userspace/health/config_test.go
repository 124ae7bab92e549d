package health

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
		{Config{Path: "/health_generate"}, ""},
		{Config{Interval: -time.Second}, "--health-interval: negative"},
		{Config{Timeout: -1}, "--health-timeout: negative"},
		{Config{Path: "health"}, `--health-path "health": want an absolute path`},
	} {
		err := tc.c.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.want)) {
			t.Errorf("%+v: %v, want %q", tc.c, err, tc.want)
		}
	}
}

func TestConfigProvision(t *testing.T) {
	if d := DefaultConfig(); d != (Config{Interval: DefaultInterval, Timeout: DefaultTimeout, Path: Path}) {
		t.Fatalf("DefaultConfig: %+v", d)
	}
	c := Config{Interval: time.Minute, Path: "/x"}
	c.Provision()
	if c != (Config{Interval: time.Minute, Timeout: DefaultTimeout, Path: "/x"}) {
		t.Fatalf("provisioned over settings: %+v", c)
	}
}
