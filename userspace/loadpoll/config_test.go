package loadpoll

import (
	"testing"
	"time"
)

func TestConfigProvision(t *testing.T) {
	for _, tc := range []struct{ in, want Config }{
		{Config{}, Config{Interval: DefaultInterval, Timeout: DefaultInterval}},
		{Config{Interval: 10 * time.Second}, Config{Interval: 10 * time.Second, Timeout: DefaultTimeout}},
		{Config{Interval: 100 * time.Millisecond}, Config{Interval: 100 * time.Millisecond, Timeout: 100 * time.Millisecond}},
		{Config{Interval: time.Hour, Timeout: time.Second}, Config{Interval: time.Hour, Timeout: time.Second}},
	} {
		c := tc.in
		c.Provision()
		if c != tc.want {
			t.Errorf("%+v provisioned: %+v, want %+v", tc.in, c, tc.want)
		}
	}
	if DefaultConfig().Interval != DefaultInterval {
		t.Fatal("DefaultConfig's interval")
	}
}
