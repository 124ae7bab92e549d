package proxy

import (
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

// TestConfigValidate: each out-of-range setting is refused, naming its
// tetherd flag; zero (the default) and the defaults are accepted.
func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		flag string // "" : accepted
		set  func(*Config)
	}{
		{"", func(*Config) {}},
		{"", func(c *Config) { *c = Defaults() }},
		{"", func(c *Config) { c.QueueSize = -1 }}, // no queue
		{"", func(c *Config) { c.ParkAfter = -time.Second }},
		{"response-timeout", func(c *Config) { c.ResponseTimeout = -1 }},
		{"stream-idle-timeout", func(c *Config) { c.StreamIdleTimeout = -1 }},
		{"idle-timeout", func(c *Config) { c.IdleTimeout = -1 }},
		{"head-timeout", func(c *Config) { c.HeadTimeout = -1 }},
		{"io-timeout", func(c *Config) { c.IOTimeout = -1 }},
		{"queue-timeout", func(c *Config) { c.QueueTimeout = -1 }},
		{"splice-min", func(c *Config) { c.SpliceMin = -1 }},
		{"max-body-bytes", func(c *Config) { c.MaxBodyBytes = -1 }},
		{"max-conns", func(c *Config) { c.MaxConns = -1 }},
		{"max-queue", func(c *Config) { c.QueueSize = -2 }},
		{"local-body-budget", func(c *Config) { c.LocalBodyBudget = -1 }},
		{"max-request-line", func(c *Config) { c.Limits.RequestLine = -1 }},
		{"max-head-bytes", func(c *Config) { c.Limits.Head = -1 }},
		{"max-header-fields", func(c *Config) { c.Limits.Fields = -1 }},
		{"max-chunk-ext-bytes", func(c *Config) { c.Limits.ChunkExt = -1 }},
	} {
		var c Config
		tc.set(&c)
		err := c.Validate()
		switch {
		case tc.flag == "" && err != nil:
			t.Errorf("refused: %v", err)
		case tc.flag != "" && (err == nil || !strings.HasPrefix(err.Error(), "--"+tc.flag+": ")):
			t.Errorf("--%s out of range: error %v, want one naming the flag", tc.flag, err)
		}
	}
}

// TestConfigProvision: a zero setting takes the default, a set one is
// kept, and a negative QueueSize (no queue) survives provisioning.
func TestConfigProvision(t *testing.T) {
	var c Config
	c.Provision()
	if c.ResponseTimeout != DefaultResponseTimeout || c.QueueSize != DefaultQueueSize || c.SpliceMin != DefaultSpliceMin ||
		c.Limits.Head != httphead.DefaultHead || c.Limits.ChunkExt != httphead.MaxChunkExtBytes || c.MaxConns != 0 || c.MaxBodyBytes != 0 {
		t.Fatalf("provisioned: %+v", c)
	}
	c = Config{IdleTimeout: time.Second, QueueSize: -1, Limits: httphead.Limits{Fields: 7}}
	c.Provision()
	if c.IdleTimeout != time.Second || c.QueueSize != -1 || c.Limits.Fields != 7 || c.HeadTimeout != DefaultHeadTimeout {
		t.Fatalf("provisioned over settings: %+v", c)
	}
	if d := Defaults(); d.IOTimeout != DefaultIOTimeout || d.Router != nil || d.Log != nil {
		t.Fatalf("Defaults: %+v", d)
	}
}
