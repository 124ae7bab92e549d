package engine

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
		{Settings{UpdateTimeout: -time.Second}, "--update-timeout: negative; want a duration > 0"},
	} {
		err := tc.s.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || err.Error() != tc.want) {
			t.Errorf("%+v: %v, want %q", tc.s, err, tc.want)
		}
	}
	if d := DefaultSettings(); d.UpdateTimeout != DefaultUpdateTimeout {
		t.Fatalf("DefaultSettings: %+v", d)
	}
	s := Settings{UpdateTimeout: time.Second}
	s.Provision()
	if s.UpdateTimeout != time.Second {
		t.Fatalf("provisioned over a setting: %+v", s)
	}
}
