"""Agent serving: the OpenAI-compatible chat endpoint a rollout worker serves to a user's
agent, its token-exact chat sessions, and the episodes an agent plays through it."""
