package cluster

import "testing"

func TestParseEndpoints(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int // endpoints; -1: refused
	}{
		{"etcd://127.0.0.1:2379", 1},
		{"etcd://a:2379,b:2379,c:2379", 3},
		{"etcd://", -1},
		{"http://a:2379", -1},
		{"etcd://a", -1},
		{"etcd://a:", -1},
		{"etcd://a:1/x", -1},
		{"etcd://a:1,,b:2", -1},
	} {
		eps, err := ParseEndpoints(tc.in)
		if tc.want < 0 {
			if err == nil {
				t.Errorf("%q accepted: %v", tc.in, eps)
			}
			continue
		}
		if err != nil || len(eps) != tc.want {
			t.Errorf("%q: %v %v", tc.in, eps, err)
		}
	}
	for name, ok := range map[string]bool{"default": true, "rl-run-7": true, "": false, "a/b": false, "a b": false} {
		if (ValidName(name) == nil) != ok {
			t.Errorf("ValidName(%q) = %v", name, ValidName(name))
		}
	}
}
