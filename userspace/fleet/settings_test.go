package fleet

import (
	"testing"
	"time"
)

func TestSettings(t *testing.T) {
	for _, tc := range []struct {
		s    Settings
		want string // "": accepted; else the error
	}{
		{Settings{}, ""},
		{DefaultSettings(), ""},
		{Settings{HoldTimeout: -time.Second}, "--pause-timeout: negative; want a duration > 0"},
	} {
		err := tc.s.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || err.Error() != tc.want) {
			t.Errorf("%+v: %v, want %q", tc.s, err, tc.want)
		}
	}
	if d := DefaultSettings(); d.HoldTimeout != DefaultHoldTimeout {
		t.Fatalf("DefaultSettings: %+v", d)
	}
	if f := New(Config{Settings: Settings{HoldTimeout: time.Second}}); f.Timeout() != time.Second {
		t.Fatalf("hold timeout %v, want the one set", f.Timeout())
	}
	if f := New(Config{}); f.Timeout() != DefaultHoldTimeout {
		t.Fatalf("hold timeout %v, want the default", f.Timeout())
	}
}
