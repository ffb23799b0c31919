// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// HolderName names a claim holder or requester for people, as every message
// of the guard and gpu-guard-ctl does: `ns/pod/container (id 0123456789ab)`
// (see ledger.DescribeOwner, which it is: one wording for both).
func HolderName(o ledger.Owner) string {
	return ledger.DescribeOwner(o)
}
