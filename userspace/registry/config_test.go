package registry

import (
	"testing"
	"time"
)

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		c    Config
		want string // "": accepted; else the error
	}{
		{Config{}, ""},
		{DefaultConfig(), ""},
		{Config{MaxInFlight: 8}, ""},
		{Config{Failures: -1}, "--health-failures: negative; want a value > 0"},
		{Config{Successes: -1}, "--health-successes: negative; want a value > 0"},
		{Config{StartupTimeout: -time.Second}, "--worker-startup-timeout: negative; want a duration > 0"},
		{Config{RemoveGrace: -1}, "--remove-grace: negative; want a duration > 0"},
	} {
		err := tc.c.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || err.Error() != tc.want) {
			t.Errorf("%+v: %v, want %q", tc.c, err, tc.want)
		}
	}
}

func TestConfigProvision(t *testing.T) {
	want := Config{Failures: DefaultFailures, Successes: DefaultSuccesses, StartupTimeout: DefaultStartupTimeout, RemoveGrace: DefaultRemoveGrace}
	if d := DefaultConfig(); d != want {
		t.Fatalf("DefaultConfig: %+v", d)
	}
	c := Config{Failures: 1, MaxInFlight: 3}
	c.Provision()
	want.Failures, want.MaxInFlight = 1, 3
	if c != want {
		t.Fatalf("provisioned over settings: %+v", c)
	}
}
