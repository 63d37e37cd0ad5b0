#include "analysis/liveness.h"

namespace spillway::analysis {

ForwardLifetime find_last_forward_use(const GraphIndex& index, const AliasChain& chain) {
  NodeId last = chain.producer;
  std::size_t last_position = index.position(chain.producer);
  auto scan = [&](NodeId chain_node) {
    for (NodeId user : index.users(chain_node)) {
      const Node& reader = index.node(user);
      if (reader.kind != NodeKind::kCallFunction || reader.phase == Phase::kBackward) continue;
      std::size_t position = index.position(user);
      if (position > last_position) {
        last = user;
        last_position = position;
      }
    }
  };
  scan(chain.producer);
  for (NodeId view : chain.lifetime_views) scan(view);

  ForwardLifetime lifetime;
  lifetime.last_forward_use = last;
  if (last == chain.producer || index.node(last).value.is_tensor()) lifetime.last_use_arg = last;
  return lifetime;
}

NodeId find_first_backward_reader(const GraphIndex& index, const AliasChain& chain) {
  NodeId first = -1;
  std::size_t first_position = 0;
  for (NodeId reader : chain.all_backward_readers()) {
    std::size_t position = index.position(reader);
    if (first == -1 || position < first_position) {
      first = reader;
      first_position = position;
    }
  }
  return first;
}

}  // namespace spillway::analysis
