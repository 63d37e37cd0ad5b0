#pragma once
// The cost model's per-node functions with the node's inputs resolved through
// a NodeLookup, so simulate() pays for the id lookup table once per graph.
// CostModel's public methods call these with a kScan lookup. Internal to
// spillway_sim; the contracts are CostModel's (include/spillway/sim.h).

#include "sim/node_lookup.h"
#include "spillway/sim.h"

namespace spillway::sim {

// CostModel::node_ms; `schema` is graph.schema_of(node).
double node_ms(const DeviceProfile& profile, const Node& node, const OpSchema* schema,
               const NodeLookup& lookup);
// CostModel::estimate_ms.
double estimate_ms(const DeviceProfile& profile, const Node& node, const OpSchema* schema,
                   const NodeLookup& lookup);
// CostModel::flops.
double flops(const Node& node, const OpSchema* schema, const NodeLookup& lookup);

// Whether the node takes no compute time (CostModel::node_ms's list).
bool takes_no_time(const Node& node, const OpSchema* schema, const NodeLookup& lookup);

}  // namespace spillway::sim
