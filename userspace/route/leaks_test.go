package route

import (
	"os"
	"testing"

	"github.com/tether-rl/tether/testenv"
)

// No test of the package may leave a goroutine, descriptor or pipe behind.
func TestMain(m *testing.M) { os.Exit(testenv.RunNoLeaks(m)) }
